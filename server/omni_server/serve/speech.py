"""`POST /v1/audio/speech`: text in, audio out, whole or streamed as each sentence is ready.

Three ways to answer (the request's `stream_format`, and our `stream` extension):
  "audio"  the body's bytes, chunked, as the pipeline's terminal stage emits them (OpenAI's
           default: a request without `stream_format` gets it; `"stream": true` too)
  "sse"    `speech.audio.delta` events (base64 of the same bytes), then `speech.audio.done`
  `"stream": false`  one response with a Content-Length once all audio is ready
Our `timestamps` extension adds the voice's word timings (serve/timing_formats.py): a
`speech.audio.word` event per word after the delta that speaks it, or, without a stream, one
JSON body (ElevenLabs' `with-timestamps`: `audio_base64`, `alignment`, plus `words`).

Streams are prepared lazily at the first chunk, so a pipeline that fails before any audio still
gets a 500 with the stage's message. A stream that fails later is cut (the connection closed,
no final chunk, no `speech.audio.done`): a client must never take a truncated stream for a
complete one. Leaving the request handle's context, for any reason (a client gone, a failure,
server shutdown), aborts the request in every stage.
"""

from __future__ import annotations

import base64
import json
import logging
import math
from typing import Any

from aiohttp import web

from omni_server.contracts import SpeechTiming
from omni_server.pipeline import PipelineError, RequestHandle
from omni_server.serve.body import read_json
from omni_server.serve.errors import STREAM_STARTED, ApiError
from omni_server.serve.metrics import RequestTrack
from omni_server.serve.pipeline_call import ApiCall, ContractError, request_error, respond
from omni_server.serve.responses import write_within
from omni_server.serve.speech_request import (
    PCM_SAMPLE_RATE,
    SpeechRequest,
    parse_speech_request,
    speech_model,
)
from omni_server.serve.timing_formats import chunk_timing, rest_alignment, words

log = logging.getLogger(__name__)

USAGE_FRAME_SECONDS = 0.02  # usage.output_tokens counts 20 ms frames: this voice has no tokens


async def create_speech(request: web.Request) -> web.StreamResponse:
    return await respond(request, "speech", _speech)


async def _speech(call: ApiCall) -> web.StreamResponse:
    body = await read_json(call.request)
    model = speech_model(body, call.state.plan)
    call.track.model = model.id
    speech = parse_speech_request(body, model, call.state.options, call.state.voices)
    async with call.pipeline(speech.model, speech.pipeline_inputs()) as handle:
        return await _answer(call.request, speech, handle, call.track)


async def _answer(
    request: web.Request, speech: SpeechRequest, handle: RequestHandle, track: RequestTrack
) -> web.StreamResponse:
    whole = bytearray()
    response: web.StreamResponse | None = None
    chunks = 0
    timings: list[SpeechTiming] = []  # the words of a whole response with timestamps
    try:
        async for chunk in handle:
            chunks += 1
            audio = _chunk_audio(chunk)
            timing = chunk_timing(chunk) if speech.timestamps else None
            if timing is not None and speech.stream_format is None:
                timings.append(timing)
            if not audio:
                continue
            track.first_audio()
            if speech.stream_format is None:
                whole += audio
                continue
            if response is None:
                response = await _start_stream(request, speech, handle)
            await write_within(request, response, _encode_chunk(speech, audio))
            if timing is not None:  # sse: each word after the audio delta that speaks it
                await write_within(request, response, _word_events(timing))
        result = await handle.result()
        # A terminal stage that does not stream (scheduler single / batch) hands the whole body
        # over in its result; one that streams reports what it sent (`audio_seconds`).
        tail = _result_audio(result, streamed=chunks > 0)
        if not whole and not tail and response is None:
            _nothing_spoken(result)
    except PipelineError as exc:
        # a stage's refusal of the input (InvalidRequest: the prompt over the model's context,
        # say) is the client's 400, as for chat; other failures are 5xx
        error = request_error(exc, handle.id)
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
    if speech.stream_format is None and speech.timestamps:
        return web.json_response(
            _with_timestamps(bytes(whole + tail), SpeechTiming.joined(timings)),
            headers={**_headers(speech, handle), "Content-Type": "application/json"},
        )
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


def _word_events(timing: SpeechTiming) -> bytes:
    """`speech.audio.word` events (our extension): a word, when it starts and ends (seconds
    from the audio's start), in speaking order."""
    return b"".join(_sse({"type": "speech.audio.word", **word}) for word in words(timing))


def _with_timestamps(audio: bytes, timing: SpeechTiming) -> dict[str, Any]:
    """The whole response with its timing, as ElevenLabs' `with-timestamps` answers (their
    `alignment` and `normalized_alignment`: the voice's text is the one it spoke, normalized),
    and the words."""
    alignment = rest_alignment(timing)
    return {
        "audio_base64": base64.b64encode(audio).decode("ascii"),
        "alignment": alignment,
        "normalized_alignment": alignment,
        "words": words(timing),
    }


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
        raise ContractError(
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
    raise ContractError(
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
    raise ContractError(
        f"the speech pipeline reported {seconds:g} s of audio but sent no bytes of it"
    )


def _audio_seconds(result: Any) -> float:
    """The result's `audio_seconds` (the speech contract); 0 for a pipeline that reports none."""
    return float(result.get("audio_seconds", 0.0)) if isinstance(result, dict) else 0.0
