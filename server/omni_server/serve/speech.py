"""`POST /v1/audio/speech`: text in, audio out, whole or streamed as each sentence is ready.

Three ways to answer (the request's `stream_format`, and our `stream` extension):
  "audio"  the body's bytes, chunked, as the pipeline's terminal stage emits them (OpenAI's
           default: a request without `stream_format` gets it; `"stream": true` too)
  "sse"    `speech.audio.delta` events (base64 of the same bytes), then `speech.audio.done`
  `"stream": false`  one response with a Content-Length once all audio is ready

Streams are prepared lazily at the first chunk, so a pipeline that fails before any audio still
gets a 500 with the stage's message. A stream that fails later is cut (the connection closed,
no final chunk, no `speech.audio.done`): a client must never take a truncated stream for a
complete one. Leaving the request handle's context, for any reason (a client gone, a failure,
server shutdown), aborts the request in every stage.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
from typing import Any

from aiohttp import web

from omni_server.compiler.plan import ModelSpec
from omni_server.errors import OUT_OF_GPU_MEMORY
from omni_server.pipeline import PipelineError, RequestHandle
from omni_server.serve.body import ClientGone, read_json
from omni_server.serve.errors import STREAM_STARTED, ApiError
from omni_server.serve.metrics import RequestTrack
from omni_server.serve.responses import write_within
from omni_server.serve.speech_request import (
    PCM_SAMPLE_RATE,
    SpeechRequest,
    parse_speech_request,
    speech_model,
)
from omni_server.serve.state import STATE

log = logging.getLogger(__name__)

CLIENT_GONE = 499  # status recorded (never sent) when the client left before the end
USAGE_FRAME_SECONDS = 0.02  # usage.output_tokens counts 20 ms frames: this voice has no tokens


async def create_speech(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    with state.metrics.track("speech") as track:
        request_id = "(not yet submitted)"
        # aiohttp cancels the handler when the client disconnects (handler_cancellation), a
        # stop cancels what outlives the grace period, and a write racing a disconnect raises;
        # leaving `async with handle` for any reason aborts the request in every stage.
        try:
            body = await read_json(request)
            model = speech_model(body, state.plan)
            track.model = model.id
            speech = parse_speech_request(body, model, state.options)
            require_ready(state.runtime, model)
            async with state.admission.place(speech.model.id):
                with state.metrics.in_pipeline(speech.model.id):
                    try:
                        handle = state.runtime.submit(speech.model, speech.pipeline_inputs())
                    except PipelineError as exc:
                        raise pipeline_error(exc) from exc
                    request_id = handle.id
                    async with handle:
                        return await _answer(request, speech, handle, track)
        except asyncio.CancelledError:
            _cancelled(request, track, request_id)
            raise
        except (ConnectionResetError, ClientGone):
            _cancelled(request, track, request_id)
            return web.Response(status=CLIENT_GONE)  # nobody is left to read it


def _cancelled(request: web.Request, track: RequestTrack, request_id: str) -> None:
    """Account a request that ended early: the server is stopping, or its client left."""
    if request.app[STATE].lifecycle.stopping:
        track.fail(503, "server_shutdown")
        log.info("speech request %s aborted: the server is shutting down", request_id)
    else:
        track.fail(CLIENT_GONE, "client_disconnected")
        log.info("speech request %s aborted: client disconnected", request_id)


def require_ready(runtime, model: ModelSpec | None = None) -> None:
    """503 unless the runtime takes requests of `model`: started, and every process the model's
    stages use has a live replica (a process of another model being down does not matter)."""
    if not runtime.ready:
        raise ApiError(503, "the pipeline is not ready; see /health/ready", code="not_ready")
    unavailable = getattr(runtime, "unavailable_for", None)  # stand-in runtimes lack it
    if model is not None and unavailable is not None:
        reason = unavailable(model)
        if reason is not None:
            raise ApiError(503, f"{model.id} is unavailable: {reason}", code="unavailable")
    elif not runtime.healthy:
        raise ApiError(503, "the pipeline is unhealthy; see /health", code="unavailable")


class SpeechContractError(PipelineError):
    """The pipeline's output broke the speech contract: checked here, so the message is ours
    (not a library's) and the client may read it."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="stage_failed")


def pipeline_error(exc: PipelineError, request_id: str | None = None) -> ApiError:
    """503 when the pipeline cannot take requests at all, 504 when a stage ran past its time,
    else 500. The message names the stage but not the exception's text: that comes from
    libraries inside the stage (paths, shapes, versions) and goes to the server log, which the
    request id finds."""
    if exc.code == "unavailable":
        return ApiError(503, exc.message, code="unavailable")
    if isinstance(exc, SpeechContractError):
        return ApiError(500, exc.message, code="pipeline_error")
    where = f"stage '{exc.stage}'" if exc.stage else "the pipeline"
    see_log = f"; the server log has the details (request {request_id})" if request_id else ""
    if exc.code == "timeout":
        return ApiError(504, f"{where} did not finish in time{see_log}", code="timeout")
    if exc.code == "process_died":
        return ApiError(500, f"the process running {where} died{see_log}", code="pipeline_error")
    if exc.error_code == OUT_OF_GPU_MEMORY:  # the request failed; the stage serves on
        return ApiError(500, f"{where} ran out of GPU memory{see_log}", code="pipeline_error")
    return ApiError(500, f"{where} failed{see_log}", code="pipeline_error")


async def _answer(
    request: web.Request, speech: SpeechRequest, handle: RequestHandle, track: RequestTrack
) -> web.StreamResponse:
    whole = bytearray()
    response: web.StreamResponse | None = None
    chunks = 0
    try:
        async for chunk in handle:
            chunks += 1
            audio = _chunk_audio(chunk)
            if not audio:
                continue
            track.first_audio()
            if speech.stream_format is None:
                whole += audio
                continue
            if response is None:
                response = await _start_stream(request, speech, handle)
            await write_within(request, response, _encode_chunk(speech, audio))
        result = await handle.result()
        # A terminal stage that does not stream (scheduler single / batch) hands the whole body
        # over in its result; one that streams reports what it sent (`audio_seconds`).
        tail = _result_audio(result, streamed=chunks > 0)
        if not whole and not tail and response is None:
            _nothing_spoken(result)
    except PipelineError as exc:
        error = pipeline_error(exc, handle.id)
        if response is None:
            log.warning("speech request %s failed: %s", handle.id, exc.message)
            raise error from exc
        track.fail(200, "pipeline_error")
        log.warning("speech request %s cut mid-stream: %s", handle.id, exc.message)
        if request.transport is not None:
            request.transport.close()  # no final chunk: the client sees a broken stream
        return response

    track.audio_seconds = _audio_seconds(result)
    if tail:
        track.first_audio()
    if speech.stream_format is None:
        return web.Response(body=bytes(whole + tail), headers=_headers(speech, handle))
    if response is None:  # no chunk: a non-streaming terminal
        response = await _start_stream(request, speech, handle)
    if tail:
        await write_within(request, response, _encode_chunk(speech, tail))
    if speech.stream_format == "sse":
        done = {"type": "speech.audio.done", "usage": _usage(speech, result)}
        await write_within(request, response, _sse(done))
    await response.write_eof()
    return response


async def _start_stream(
    request: web.Request, speech: SpeechRequest, handle: RequestHandle
) -> web.StreamResponse:
    headers = _headers(speech, handle)
    if speech.stream_format == "sse":
        headers["Content-Type"] = "text/event-stream"
        headers["Cache-Control"] = "no-cache"
    response = web.StreamResponse(headers=headers)
    response.enable_chunked_encoding()
    request[STREAM_STARTED] = True
    await response.prepare(request)
    return response


def _headers(speech: SpeechRequest, handle: RequestHandle) -> dict[str, str]:
    headers = {"Content-Type": speech.content_type, "X-Request-Id": handle.id}
    if speech.response_format == "pcm":
        headers["X-Sample-Rate"] = str(speech.sample_rate or PCM_SAMPLE_RATE)
        headers["X-Channels"] = "1"
        headers["X-Bit-Depth"] = "16"
    return headers


def _encode_chunk(speech: SpeechRequest, audio: bytes) -> bytes:
    if speech.stream_format == "sse":
        delta = base64.b64encode(audio).decode("ascii")
        return _sse({"type": "speech.audio.delta", "audio": delta})
    return audio


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def _usage(speech: SpeechRequest, result: Any) -> dict[str, int]:
    input_tokens = len(speech.text)  # characters: the voice phonemizes text, it has no tokenizer
    output_tokens = math.ceil(_audio_seconds(result) / USAGE_FRAME_SECONDS)
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "total_tokens": input_tokens + output_tokens,
    }


def _chunk_audio(chunk: Any) -> bytes:
    """The body bytes of one terminal chunk: the speech contract is `{"audio": bytes}`."""
    audio = chunk.get("audio") if isinstance(chunk, dict) else None
    if not isinstance(audio, bytes | bytearray):
        keys = sorted(chunk) if isinstance(chunk, dict) else type(chunk).__name__
        raise SpeechContractError(
            f"a speech pipeline's terminal chunks must be {{'audio': bytes}}; got {keys}"
        )
    return bytes(audio)


def _result_audio(result: Any, *, streamed: bool) -> bytes:
    """Body bytes carried by the terminal result; refuses a result that accounts for no audio.

    Without this check a terminal stage that returned its audio under another key would
    answer 200 with an empty body: a failure dressed as a success.
    """
    if isinstance(result, dict) and isinstance(result.get("audio"), bytes | bytearray):
        return bytes(result["audio"])
    if streamed or (isinstance(result, dict) and "audio_seconds" in result):
        return b""
    keys = sorted(result) if isinstance(result, dict) else type(result).__name__
    raise SpeechContractError(
        "the speech pipeline's terminal stage produced no audio: it must stream "
        f"{{'audio': bytes}} chunks or return {{'audio': bytes}}; its result had {keys}"
    )


def _nothing_spoken(result: Any) -> None:
    """A pipeline that sent no byte at all: mp3, opus, aac and pcm have no valid empty file, so
    this is never a 200. No audio either: the voice found nothing to say in the input (400).
    Audio but no bytes: the pipeline lost them (500)."""
    seconds = _audio_seconds(result)
    if seconds == 0:
        raise ApiError(
            400,
            "the model found nothing to speak in 'input' (it made no audio)",
            param="input",
            code="invalid_value",
        )
    raise SpeechContractError(
        f"the speech pipeline reported {seconds:g} s of audio but sent no bytes of it"
    )


def _audio_seconds(result: Any) -> float:
    """The result's `audio_seconds` (the speech contract); 0 for a pipeline that reports none."""
    return float(result.get("audio_seconds", 0.0)) if isinstance(result, dict) else 0.0
