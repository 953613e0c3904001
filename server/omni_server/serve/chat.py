"""`POST /v1/chat/completions`: messages in, the model's answer out, as text or text and audio.

The pipeline's terminal chunks are told apart by their keys, never by stage names: `{"text":
str}` is the next piece of the answer, `{"audio": bytes}` the next bytes of its speech. The
result is the text terminal's payload (`text`, `finish_reason`, `usage`), or, for a model with
a voice, a dict of terminal -> payload with the audio terminal's (`audio_seconds`) beside it.

Two ways to answer:
  whole   one `chat.completion` once the pipeline is done; with audio, `message.audio` holds
          the whole file (base64) and its transcript, and `message.content` is null (as OpenAI)
  stream  SSE `chat.completion.chunk`s: the role, then each text chunk as `delta.content` (with
          audio: `delta.audio.transcript`, and each audio chunk as `delta.audio.data`), a last
          chunk with `finish_reason`, the usage chunk if asked for, then `data: [DONE]`

A stream is prepared at its first chunk, so a request the thinker refuses before writing (a
prompt over its context: 400 `context_length_exceeded`) gets OpenAI's error JSON in both modes.
A stream that fails later sends an `error` event and is cut without `data: [DONE]`. Leaving the
request handle's context, for any reason (a client gone, a failure, server shutdown), aborts the
request in every stage.

Audio in: `input_audio` parts of user messages are heard first by the repository's
transcription model; their transcripts take their place in the messages the thinker reads. A
model that hears audio itself (`audio_input = "native"`) gets them instead as
`contracts.AudioPart`s in the messages, in the client's order, and no transcription runs.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from omni_server.contracts import AsrOptions
from omni_server.pipeline import PipelineError, RequestHandle
from omni_server.serve.admission import RATE_LIMITED
from omni_server.serve.body import read_json
from omni_server.serve.chat_request import (
    AudioContent,
    ChatRequest,
    chat_model,
    parse_chat_request,
)
from omni_server.serve.errors import STREAM_STARTED, ApiError
from omni_server.serve.metrics import RequestTrack
from omni_server.serve.pipeline_call import (
    ApiCall,
    ContractError,
    admitted,
    pipeline_error,
    request_error,
    require_ready,
    respond,
    submitted,
)
from omni_server.serve.state import ServerState

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length")


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    return await respond(request, "chat", _chat)


async def _chat(call: ApiCall) -> web.StreamResponse:
    body = await read_json(call.request)
    model = chat_model(body, call.state.plan)
    call.track.model = model.id
    chat = parse_chat_request(body, model, call.state.voices)
    require_ready(call.state.runtime, model)  # before any audio part is heard for nothing
    if chat.audio_parts and not model.hears_audio:  # heard first: the thinker reads text
        chat = await hear_audio_parts(call.state, chat)
    # the completion's id is the request's id in the runtime and the logs
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    async with call.pipeline(
        model, chat.pipeline_inputs(), request_id=request_id, errors=request_error
    ) as handle:
        if chat.stream:
            return await _stream(call.request, chat, handle, call.track)
        return await _whole(chat, handle, call.track)


async def hear_audio_parts(state: ServerState, chat: ChatRequest) -> ChatRequest:
    """Transcribe every `input_audio` part with the repository's transcription model (in
    parallel, under one admission place of that model: the parts are one chat request's); audio
    it cannot use is a 400 naming the part."""
    asr = next((m for m in state.plan.models.values() if "transcription" in m.tasks), None)
    if asr is None:
        raise ApiError(
            400,
            "this server has no transcription model to hear input_audio parts; send text",
            param=chat.audio_parts[0].param,
            code="unsupported_value",
        )

    async def hear(part: AudioContent) -> tuple[str, str]:
        try:
            async with submitted(state, asr, AsrOptions().payload(part.data)) as handle:
                result = await handle.result()
        except PipelineError as exc:
            if exc.code == "invalid_request" and exc.error_code == RATE_LIMITED:
                raise request_error(exc) from exc  # the ASR is full now: 429, retry
            if exc.code == "invalid_request":  # the part is no usable audio: the caller's fault
                raise ApiError(
                    400, f"'{part.param}': {exc.message}", param=part.param, code="invalid_audio"
                ) from exc
            raise pipeline_error(exc) from exc
        if not isinstance(result, dict) or not isinstance(result.get("text"), str):
            error = ContractError(f"the transcription model {asr.id} returned no text")
            raise pipeline_error(error) from error
        return part.param, result["text"]

    async with admitted(state, asr):
        heard = await asyncio.gather(*(hear(part) for part in chat.audio_parts))
    return chat.transcribed(dict(heard))


@dataclass
class _Answer:
    """What the pipeline said so far; `created` and the ids are shared by every chunk."""

    chat: ChatRequest
    id: str
    created: int = field(default_factory=lambda: int(time.time()))
    audio_id: str = field(default_factory=lambda: f"audio_{uuid.uuid4().hex}")
    text: list[str] = field(default_factory=list)
    audio: bytearray = field(default_factory=bytearray)


async def _whole(chat: ChatRequest, handle: RequestHandle, track: RequestTrack) -> web.Response:
    answer = _Answer(chat, handle.id)
    try:
        async for _, chunk in handle.stream():
            text, audio = _chunk(chunk)
            if text:
                answer.text.append(text)
            elif audio and chat.audio is not None:
                track.first_audio()
                answer.audio += audio
        reply, spoken = _payloads(await handle.result(), chat)
    except PipelineError as exc:
        log.warning("chat request %s failed: %s", handle.id, exc.message)
        raise request_error(exc, handle.id) from exc
    transcript = "".join(answer.text) if answer.text else reply["text"]
    message: dict[str, Any] = {"role": "assistant", "content": transcript, "refusal": None}
    if chat.audio is not None:
        tail = spoken.get("audio") if spoken else None
        if isinstance(tail, bytes | bytearray):  # a terminal that does not stream its audio
            track.first_audio()
            answer.audio += tail
        track.audio_seconds = _check_audio(spoken, len(answer.audio))
        message["content"] = None  # OpenAI: with audio out, the text is the audio's transcript
        message["audio"] = {
            "id": answer.audio_id,
            "data": base64.b64encode(answer.audio).decode("ascii"),
            "expires_at": answer.created,  # nothing is kept to refer to later: expired at once
            "transcript": transcript,
        }
    completion = {
        "id": answer.id,
        "object": "chat.completion",
        "created": answer.created,
        "model": chat.model.id,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": reply["finish_reason"],
                "logprobs": None,
            }
        ],
        "usage": _usage(reply),
    }
    return web.json_response(completion, headers={"X-Request-Id": handle.id})


async def _stream(
    request: web.Request, chat: ChatRequest, handle: RequestHandle, track: RequestTrack
) -> web.StreamResponse:
    answer = _Answer(chat, handle.id)
    response: web.StreamResponse | None = None
    audio_started = False
    try:
        async for _, chunk in handle.stream():
            text, audio = _chunk(chunk)
            if not text and not (audio and chat.audio is not None):
                continue
            if response is None:
                response = await _start(request, answer)
            if text:
                answer.text.append(text)
                if chat.audio is None:
                    delta: dict[str, Any] = {"content": text}
                else:
                    delta = {"audio": _audio_delta(answer, audio_started, transcript=text)}
                    audio_started = True
            else:
                track.first_audio()
                answer.audio += audio
                delta = {"audio": _audio_delta(answer, audio_started, data=audio)}
                audio_started = True
            await response.write(_sse(_chunk_object(answer, delta)))
        reply, spoken = _payloads(await handle.result(), chat)
        if chat.audio is not None:
            track.audio_seconds = _check_audio(spoken, len(answer.audio))
    except PipelineError as exc:
        error = request_error(exc, handle.id)
        if response is None:
            log.warning("chat request %s failed: %s", handle.id, exc.message)
            raise error from exc
        track.fail(200, "pipeline_error")
        log.warning("chat request %s cut mid-stream: %s", handle.id, exc.message)
        await response.write(_sse({"error": _error_object(error)}))
        if request.transport is not None:
            request.transport.close()  # no [DONE]: the client sees a broken stream
        return response

    if response is None:  # nothing streamed: a thinker that hands its text over at the end
        response = await _start(request, answer)
    if not answer.text and reply["text"]:
        answer.text.append(reply["text"])
        delta = (
            {"content": reply["text"]}
            if chat.audio is None
            else {"audio": _audio_delta(answer, audio_started, transcript=reply["text"])}
        )
        audio_started = audio_started or chat.audio is not None
        await response.write(_sse(_chunk_object(answer, delta)))
    if chat.audio is not None:
        # OpenAI ends an audio answer with the audio's expiry (and its id, if nothing came)
        end = _audio_delta(answer, audio_started)
        end["expires_at"] = answer.created
        await response.write(_sse(_chunk_object(answer, {"audio": end})))
    await response.write(_sse(_chunk_object(answer, {}, finish_reason=reply["finish_reason"])))
    if chat.include_usage:
        usage_chunk = _chunk_object(answer, None)
        usage_chunk["usage"] = _usage(reply)
        await response.write(_sse(usage_chunk))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _start(request: web.Request, answer: _Answer) -> web.StreamResponse:
    """Send the headers and the first chunk: the assistant's role."""
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Request-Id": answer.id,
        }
    )
    response.enable_chunked_encoding()
    request[STREAM_STARTED] = True
    await response.prepare(request)
    content = "" if answer.chat.audio is None else None
    role = {"role": "assistant", "content": content, "refusal": None}
    await response.write(_sse(_chunk_object(answer, role)))
    return response


def _audio_delta(
    answer: _Answer, started: bool, *, transcript: str | None = None, data: bytes | None = None
) -> dict[str, Any]:
    """One `delta.audio`: the id in the first one only (clients join the fields of the deltas)."""
    delta: dict[str, Any] = {} if started else {"id": answer.audio_id}
    if transcript is not None:
        delta["transcript"] = transcript
    if data is not None:
        delta["data"] = base64.b64encode(data).decode("ascii")
    return delta


def _chunk_object(
    answer: _Answer, delta: dict[str, Any] | None, finish_reason: str | None = None
) -> dict[str, Any]:
    """A `chat.completion.chunk`; `delta=None` is the usage chunk (no choices)."""
    chunk: dict[str, Any] = {
        "id": answer.id,
        "object": "chat.completion.chunk",
        "created": answer.created,
        "model": answer.chat.model.id,
        "choices": []
        if delta is None
        else [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
    }
    if answer.chat.include_usage:
        chunk["usage"] = None  # OpenAI: null on every chunk but the last
    return chunk


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


def _error_object(error: ApiError) -> dict[str, Any]:
    return {"message": error.message, "type": error.type, "param": error.param, "code": error.code}


def _chunk(chunk: Any) -> tuple[str, bytes]:
    """(text, audio) of one terminal chunk: `{"text": str}` or `{"audio": bytes}`."""
    if isinstance(chunk, dict):
        text = chunk.get("text")
        if isinstance(text, str):
            return text, b""
        audio = chunk.get("audio")
        if isinstance(audio, bytes | bytearray):
            return "", bytes(audio)
    keys = sorted(chunk) if isinstance(chunk, dict) else type(chunk).__name__
    raise ContractError(
        "a chat pipeline's terminal chunks must be {'text': str} or {'audio': bytes}; "
        f"got {keys}"
    )


def _payloads(result: Any, chat: ChatRequest) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The text terminal's payload (checked) and the audio terminal's, if the model has one.

    One terminal: its payload is the result. Several: a dict terminal -> payload, told apart
    by their keys (`audio_seconds` for audio; `finish_reason` without it for text: an audio
    terminal may say why its speech ended too)."""
    if isinstance(result, dict) and "finish_reason" in result:
        payloads = [result]
    elif isinstance(result, dict):
        payloads = [p for p in result.values() if isinstance(p, dict)]
    else:
        payloads = []
    texts = [p for p in payloads if "finish_reason" in p and "audio_seconds" not in p]
    audios = [p for p in payloads if "audio_seconds" in p]
    if len(texts) != 1 or len(audios) > 1:
        shape = sorted(result) if isinstance(result, dict) else type(result).__name__
        raise ContractError(
            "a chat pipeline must end in one text terminal (a payload with 'text', "
            f"'finish_reason', 'usage') and at most one audio terminal; its result had {shape}"
        )
    reply = texts[0]
    if reply["finish_reason"] not in FINISH_REASONS or not isinstance(reply.get("text"), str):
        raise ContractError(
            "the text terminal's payload must have 'text' (a string) and 'finish_reason' "
            f"({' or '.join(FINISH_REASONS)}); got finish_reason {reply['finish_reason']!r}"
        )
    usage = reply.get("usage")
    counts = ("prompt_tokens", "completion_tokens")
    if not isinstance(usage, dict) or not all(_count(usage.get(k)) for k in counts):
        raise ContractError(
            "the text terminal's payload must have 'usage' with 'prompt_tokens' and "
            f"'completion_tokens' (integers); got {usage!r}"
        )
    spoken = audios[0] if audios else None
    if chat.audio is not None and spoken is None:
        raise ContractError(
            f"the model '{chat.model.id}' made no audio for a request that asked for it: its "
            "pipeline has no terminal reporting 'audio_seconds'"
        )
    return reply, spoken


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_audio(spoken: dict[str, Any] | None, sent: int) -> float:
    """The audio terminal's `audio_seconds`; a pipeline that reports audio but sent no byte of
    it lost it (a 500, never an empty file dressed as an answer)."""
    seconds = spoken.get("audio_seconds") if spoken else None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
        raise ContractError(f"the audio terminal's 'audio_seconds' is {seconds!r}")
    if seconds > 0 and sent == 0:
        raise ContractError(
            f"the chat pipeline reported {seconds:g} s of audio but sent no bytes of it"
        )
    return float(seconds)


def _usage(reply: dict[str, Any]) -> dict[str, int]:
    usage = reply["usage"]
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
