"""`POST /v1/audio/transcriptions`: audio in, its transcript out, whole or streamed as it is heard.

The multipart upload is read within bounds (`multipart`), handed to the model's
pipeline as bytes, and the pipeline's transcript is rendered in the asked format
(`transcription_format`). With `stream=true` the answer is OpenAI's SSE: one
`transcript.text.delta` per text chunk the terminal stage yields (a batch of recognized segments),
then `transcript.text.done` with the whole text (no usage: see below).

An upload the pipeline cannot use (not audio, corrupt, truncated, too long) is refused by a
stage with `InvalidRequest` and answered 400 with its message and code, never a 500. A stream
that fails after its first event is cut (no `transcript.text.done`). Leaving the request
handle's context, for any reason, aborts the request in every stage; a client that leaves
mid-upload or mid-answer is counted as `client_disconnected`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from omni_server.pipeline import PipelineError, RequestHandle
from omni_server.serve import transcription_format as fmt
from omni_server.serve.body import ClientGone
from omni_server.serve.errors import STREAM_STARTED, ApiError
from omni_server.serve.metrics import RequestTrack
from omni_server.serve.multipart import Form, read_form
from omni_server.serve.pipeline_call import ApiCall, request_error, respond
from omni_server.serve.state import STATE
from omni_server.serve.transcription_request import (
    TranscriptionRequest,
    parse_transcription,
    transcription_model,
)

log = logging.getLogger(__name__)


async def create_transcription(request: web.Request) -> web.StreamResponse:
    return await respond(request, "transcription", _transcription)


async def _transcription(call: ApiCall) -> web.StreamResponse:
    form = await _read_upload(call.request)
    model = transcription_model(form, call.state.plan)
    call.track.model = model.id
    asr = parse_transcription(form, model)
    del form  # the file's bytes live on in `asr` only
    async with call.pipeline(model, asr.pipeline_inputs(), errors=request_error) as handle:
        return await _answer(call.request, asr, handle, call.track)


async def _read_upload(request: web.Request) -> Form:
    """The multipart form within the server's body timeout (408 after it, as other bodies)."""
    timeout = request.app[STATE].options.body_timeout_s
    try:
        async with asyncio.timeout(timeout):
            return await read_form(request)
    except TimeoutError:
        raise ApiError(
            408,
            f"the upload did not arrive within {timeout:g} s",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    except RequestPayloadError as exc:
        if request.transport is None or request.transport.is_closing():
            raise ClientGone() from exc
        raise ApiError(
            400,
            "the request body's Content-Encoding, length or chunked framing is broken",
            code="invalid_body",
            headers={"Connection": "close"},
        ) from None


async def _answer(
    request: web.Request, asr: TranscriptionRequest, handle: RequestHandle, track: RequestTrack
) -> web.StreamResponse:
    response: web.StreamResponse | None = None
    try:
        async for chunk in handle:
            delta = _chunk_text(chunk)
            if not asr.stream or not delta:
                continue
            if response is None:
                response = await _start_stream(request, handle)
            event: dict[str, Any] = {"type": "transcript.text.delta", "delta": delta}
            if asr.logprobs:
                event["logprobs"] = chunk.get("logprobs", [])
            await response.write(_sse(event))
        transcript = _transcript(await handle.result())
    except PipelineError as exc:
        error = request_error(exc, handle.id)
        if response is None:
            log.warning("transcription %s failed: %s", handle.id, exc.message)
            raise error from exc
        track.fail(200, "pipeline_error")
        log.warning("transcription %s cut mid-stream: %s", handle.id, exc.message)
        if request.transport is not None:
            request.transport.close()  # no done event: the client sees a broken stream
        return response

    if not asr.stream:
        body = fmt.render(transcript, asr.response_format, asr.granularities, asr.logprobs)
        headers = {
            "Content-Type": fmt.CONTENT_TYPES[asr.response_format],
            "X-Request-Id": handle.id,
        }
        return web.Response(body=body.encode("utf-8"), headers=headers)
    if response is None:  # silence: no delta, only the done event
        response = await _start_stream(request, handle)
    # No usage: OpenAI's done event carries token usage only (`{"type": "tokens", ...}`), which
    # Whisper's audio has no count of; the duration usage of the whole response is not allowed
    # here, and the official client's `TranscriptionTextDoneEvent` refuses it.
    done: dict[str, Any] = {"type": "transcript.text.done", "text": transcript["text"]}
    if asr.logprobs:
        done["logprobs"] = fmt.token_logprobs(transcript["segments"])
    await response.write(_sse(done))
    await response.write_eof()
    return response


def _transcript(result: Any) -> dict[str, Any]:
    """The terminal result, checked against the transcription contract."""
    needed = ("text", "language", "duration", "segments")
    if not isinstance(result, dict) or any(k not in result for k in needed):
        keys = sorted(result) if isinstance(result, dict) else type(result).__name__
        raise PipelineError(
            f"a transcription pipeline's terminal result must have {', '.join(needed)}; "
            f"it had {keys}",
            code="stage_failed",
        )
    return result


def _chunk_text(chunk: Any) -> str:
    text = chunk.get("text") if isinstance(chunk, dict) else None
    if not isinstance(text, str):
        keys = sorted(chunk) if isinstance(chunk, dict) else type(chunk).__name__
        raise PipelineError(
            f"a transcription pipeline's terminal chunks must be {{'text': str}}; got {keys}",
            code="stage_failed",
        )
    return text


async def _start_stream(request: web.Request, handle: RequestHandle) -> web.StreamResponse:
    headers = {
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        "X-Request-Id": handle.id,
    }
    response = web.StreamResponse(headers=headers)
    response.enable_chunked_encoding()
    request[STREAM_STARTED] = True
    await response.prepare(request)
    return response


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()
