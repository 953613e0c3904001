"""`GET /v1/audio/speech/stream-input` and ElevenLabs' `GET /v1/text-to-speech/{voice_id}/
stream-input`: text in as it is written, audio out, over a WebSocket.

The protocol follows ElevenLabs' input streaming (docs/stream_input.md). Client messages are
JSON text frames:
  {"text": "Hello, wor"}               a delta of the text, buffered until a sentence completes
  {"text": "ld.", "flush": true}       flush: speak everything buffered now, complete or not
  {"cancel": true}                     drop the buffered text, stop the sentence being spoken
  {"text": ""}                         the end: speak what is left, send {"isFinal": true}, close
The first message may also carry the settings (else the query's): `model`, `voice`,
`output_format` (ElevenLabs' names: `pcm_24000`, `mp3_44100_128`, `ulaw_8000`, ...), `binary`
(audio as binary frames instead of JSON), `speed`, `seed`; ElevenLabs' `voice_settings` (its
`speed`), `generation_config` and `try_trigger_generation` are accepted.

The server sends `{"audio": base64 bytes, "isFinal": false, ...}` (or each chunk as one binary
frame), `{"isFinal": true}` after the last audio, `{"cancelled": true}` after a cancel, and an
error for a bad message (the socket stays open) or a failure (the socket then closes, 1008 for
the client's fault, 1011 for the server's, and no `isFinal`: a client never takes a cut stream
for whole). The path picks the error's shape: ours sends OpenAI's `{"error": {...}}`, ElevenLabs'
path sends theirs, `{"message", "error", "code"}` (their SDK reads `message`), and defaults to
their SDK's `mp3_44100_128`.

Each complete sentence is one speech request of the model through the one request path
(serve/pipeline_call.py: admission, submit, abort on leaving), spoken in order; the next
sentence's request starts as soon as the previous one's audio has all been sent. Bounded:
message size, buffered text, characters per session, time without a client message, the
session's length, each write to a client that does not read, and the sessions open at once
(`--max-speech-stream-sessions`: one more is refused with 429 and `Retry-After` before the
upgrade, as realtime refuses one).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web

from omni_server.compiler.plan import ModelSpec
from omni_server.contracts import SpeechOptions, SpeechTiming, speech_payload
from omni_server.pipeline import PipelineError
from omni_server.serve.errors import ApiError
from omni_server.serve.pipeline_call import admitted, request_error, submitted
from omni_server.serve.sentences import SentenceBuffer, speakable
from omni_server.serve.state import STATE, ServerState
from omni_server.serve.stream_formats import StreamEncoder
from omni_server.serve.stream_settings import (
    DEFAULT_FORMAT,
    ELEVENLABS_DEFAULT_FORMAT,
    Settings,
    read_settings,
)
from omni_server.serve.timing_formats import chunk_timing, ws_alignment
from omni_server.serve.validation import check_json_text
from omni_server.serve.websocket import BoundedWebSocket

log = logging.getLogger(__name__)

PATH = "/v1/audio/speech/stream-input"
ELEVENLABS_PATH = "/v1/text-to-speech/{voice_id}/stream-input"  # ElevenLabs' own, for their SDK
MAX_MESSAGE_BYTES = 64 * 1024
MAX_BUFFERED_CHARS = 4096  # text received and not yet spoken (pending and queued sentences)
MAX_SENTENCE_CHARS = 400  # a run-on text is cut at a space past this
MAX_SESSION_CHARS = 100_000
MAX_SESSION_S = 900.0

_SPEAKING = ("text", "flush", "cancel", "try_trigger_generation")


@dataclass
class _Sentence:
    text: str
    final: bool = False  # the end marker: after it, {"isFinal": true}


class _Closed(Exception):
    """The session ends (a failure already told to the client, or the socket went)."""


async def stream_input(request: web.Request) -> web.WebSocketResponse:
    state = request.app[STATE]
    query = dict(request.query)
    voice_id = request.match_info.get("voice_id")
    elevenlabs = voice_id is not None  # their path: their defaults and error shape
    if voice_id is not None:
        query["voice"] = voice_id
    default_format = ELEVENLABS_DEFAULT_FORMAT if elevenlabs else DEFAULT_FORMAT
    # ApiError: a 4xx, no upgrade
    settings = read_settings(state, query, None, default_format=default_format)
    assert settings is not None
    if not state.runtime.ready:
        raise ApiError(503, "the pipeline is not ready", code="unavailable")
    ws = BoundedWebSocket(max_msg_size=MAX_MESSAGE_BYTES, heartbeat=30.0)
    if not ws.can_prepare(request).ok:
        raise ApiError(
            400, f"{request.path} is a WebSocket: send an upgrade request", code="invalid_request"
        )
    # the place is taken before the upgrade: a client over the bound costs no socket held for
    # a session (no await between the check and the add: two connects cannot both take the
    # last place)
    sessions = state.speech_streams
    sessions.check_room(
        state.options.max_speech_stream_sessions,
        what="speech input streams",
        flag="--max-speech-stream-sessions",
    )
    session = SpeechStream(state, ws, settings, query, elevenlabs=elevenlabs)
    sessions.add(session)
    try:
        await ws.prepare(request)
        try:
            await asyncio.wait_for(session.run(), MAX_SESSION_S)
        except TimeoutError:
            await session.fail(
                ApiError(408, f"the session ran past {MAX_SESSION_S:g} s", code="session_expired")
            )
        finally:
            await session.close()
    finally:
        sessions.discard(session)
    return ws


class SpeechStream:
    def __init__(
        self,
        state: ServerState,
        ws: web.WebSocketResponse,
        settings: Settings,
        query: dict[str, str],
        *,
        elevenlabs: bool = False,
    ) -> None:
        self.state, self.ws, self.settings, self._query = state, ws, settings, query
        self.elevenlabs = elevenlabs  # ElevenLabs' path: their error shape and default format
        self._default_format = ELEVENLABS_DEFAULT_FORMAT if elevenlabs else DEFAULT_FORMAT
        self._encoder: StreamEncoder | None = None  # made once the settings are final
        self.buffer = SentenceBuffer(MAX_SENTENCE_CHARS)
        self._queue: asyncio.Queue[_Sentence] = asyncio.Queue()
        self._queued_chars = 0
        self._received = 0
        self._first = True
        self._ended = False
        self._speaker: asyncio.Task[None] | None = None
        self._current: asyncio.Task[None] | None = None  # the sentence being spoken

    # ---- client messages -------------------------------------------------------------------

    async def run(self) -> None:
        self._speaker = asyncio.create_task(self._speak_all())
        while not self.ws.closed:
            idle_s = self.settings.inactivity_timeout_s
            try:
                message = await asyncio.wait_for(self.ws.receive(), idle_s)
            except TimeoutError:
                if self._busy():
                    continue  # audio still being made: the client may be listening
                await self.fail(
                    ApiError(
                        408,
                        f'no message for {idle_s:g} s: send text, {{"text": " "}} to keep '
                        f'the session, or {{"text": ""}} to end it',
                        code="input_timeout_exceeded",
                    )
                )
                return
            if message.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                return
            if message.type == WSMsgType.ERROR:
                return
            if message.type != WSMsgType.TEXT:
                await self._refuse("messages are JSON text frames", "invalid_message")
                continue
            await self._receive(message.data)
            if self._ended:
                await self._speaker  # speaks what is left, then sends isFinal and closes
                return

    async def _receive(self, data: str) -> None:
        try:
            message = json.loads(data)
        except (json.JSONDecodeError, RecursionError):
            await self._refuse("the message is not valid JSON", "invalid_json")
            return
        if not isinstance(message, dict):
            await self._refuse(
                'a message is a JSON object, e.g. {"text": "Hello "}', "invalid_message"
            )
            return
        if self._ended:
            await self._refuse('the text has ended ({"text": ""} was sent)', "stream_ended")
            return
        first, self._first = self._first, False
        settled = not first
        try:
            if first:
                settings = read_settings(
                    self.state, self._query, message, default_format=self._default_format
                )
                assert settings is not None
                self.settings, settled = settings, True
            else:
                read_settings(self.state, {}, message, only=_SPEAKING)
            # a lone surrogate is refused here (the message only), never reaches a stage
            check_json_text(message)
        except ApiError as err:
            if not settled:  # a session without valid settings cannot speak: it ends here
                await self.fail(err)
                return
            await self._send_error(err)
            return
        text = message.get("text")
        if message.get("cancel") is True:
            await self._cancel()
            return
        if text is None:
            return  # settings only (a first message without text)
        if text == "" and not message.get("flush"):
            self._ended = True
            self._enqueue(self.buffer.flush())
            self._queue.put_nowait(_Sentence("", final=True))
            return
        unspoken = self.buffer.pending + self._queued_chars + len(text)
        if unspoken > MAX_BUFFERED_CHARS:
            await self._refuse(
                f"{unspoken} characters would wait to be spoken; at most {MAX_BUFFERED_CHARS} "
                "may: send the rest once more audio has arrived",
                "buffer_full",
                param="text",
            )
            return
        self._received += len(text)
        if self._received > MAX_SESSION_CHARS:
            await self.fail(
                ApiError(
                    400,
                    f"the session's text passed {MAX_SESSION_CHARS} characters",
                    param="text",
                    code="session_text_too_long",
                )
            )
            return
        for sentence in self.buffer.push(text):
            self._enqueue(sentence)
        if message.get("flush") is True:
            self._enqueue(self.buffer.flush())

    def _enqueue(self, text: str) -> None:
        if text and speakable(text):
            self._queued_chars += len(text)
            self._queue.put_nowait(_Sentence(text))

    async def _cancel(self) -> None:
        """Drop the text not yet spoken and abort the sentence being spoken (in every stage)."""
        self.buffer.clear()
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queued_chars = 0
        current = self._current
        if current is not None:
            current.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await current
        await self._send({"cancelled": True})

    def _busy(self) -> bool:
        return self._current is not None or not self._queue.empty()

    # ---- audio out -------------------------------------------------------------------------

    async def _speak_all(self) -> None:
        try:
            while True:
                sentence = await self._queue.get()
                if sentence.final:
                    tail = self._encoder.finish() if self._encoder is not None else b""
                    if tail:  # an MP3 encoder's last frame
                        await self._audio(tail)
                    await self._send({"isFinal": True})
                    await self.ws.close()
                    return
                self._queued_chars -= len(sentence.text)
                self._current = asyncio.create_task(self._speak(sentence.text))
                try:
                    await self._current
                except asyncio.CancelledError:
                    if self._speaker is not None and self._speaker.cancelling():
                        raise  # the session ends
                    # else a client's cancel stopped this sentence; the session goes on
                finally:
                    self._current = None
        except _Closed:
            return

    async def _speak(self, text: str) -> None:
        settings, state = self.settings, self.state
        model: ModelSpec = settings.model
        speech = SpeechOptions(
            settings.voice.name,
            response_format="pcm",
            stream=True,
            speed=settings.speed,
            seed=settings.seed,
            sample_rate=settings.output.rate,
            reference=settings.voice.reference,
            timing=True,  # alignment rides with every audio message
        )
        # a space after the sentence: its timing's characters end with it, so the alignments
        # of a session's sentences, joined, are its text
        inputs = speech_payload(text if text[-1:].isspace() else text + " ", speech)
        try:
            async with (
                admitted(state, model),
                submitted(state, model, inputs, errors=request_error) as handle,
            ):
                try:
                    await self._relay(handle, bytes_per_s=2 * settings.output.rate)
                    await handle.result()
                except PipelineError as exc:
                    log.warning("speech stream sentence %s failed: %s", handle.id, exc.message)
                    await self.fail(request_error(exc, handle.id))
                    raise _Closed from exc
        except ApiError as err:  # not ready, no admission place
            await self.fail(err)
            raise _Closed from err

    async def _relay(self, handle: Any, *, bytes_per_s: int) -> None:
        """One sentence's audio to the client, each message with the alignment of the words
        timed since the last (ElevenLabs': milliseconds from that chunk's start; an encoder
        that holds samples back, MP3's, sends them with the next message)."""
        sent_s = 0.0  # the sentence's PCM seconds before this chunk
        timings: list[SpeechTiming] = []
        async for chunk in handle:
            audio = chunk.get("audio") if isinstance(chunk, dict) else None
            timing = chunk_timing(chunk)
            if timing is not None:
                timings.append(timing)
            if isinstance(audio, bytes | bytearray) and audio:
                encoded = self._encoded(bytes(audio))
                if encoded:
                    alignment = None
                    if timings:
                        alignment = ws_alignment(SpeechTiming.joined(timings), sent_s)
                        timings.clear()
                    await self._audio(encoded, alignment)
                sent_s += len(audio) / bytes_per_s

    def _encoded(self, pcm16: bytes) -> bytes:
        """The voice's PCM16 in the session's format; one encoder for the whole session."""
        if self._encoder is None:
            self._encoder = StreamEncoder(self.settings.output)
        return self._encoder.encode(pcm16)

    async def _audio(self, data: bytes, alignment: dict[str, Any] | None = None) -> None:
        if self.settings.binary:  # a binary frame has no room for the alignment
            await self._write(self.ws.send_bytes(data))
        else:
            # the voice's text is what it spoke, normalized: both alignments show it
            await self._send(
                {
                    "audio": base64.b64encode(data).decode("ascii"),
                    "isFinal": False,
                    "normalizedAlignment": alignment,
                    "alignment": alignment,
                }
            )

    # ---- sending ---------------------------------------------------------------------------

    async def _send(self, message: dict[str, Any]) -> None:
        await self._write(self.ws.send_str(json.dumps(message)))

    async def _write(self, sending: Any) -> None:
        """One frame, within the write timeout: a client that reads nothing is dropped."""
        if self.ws.closed:
            sending.close()
            raise _Closed
        try:
            await asyncio.wait_for(sending, self.state.options.write_timeout_s)
        except (TimeoutError, ConnectionResetError):
            await self.ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"not reading")
            raise _Closed from None

    async def _refuse(self, message: str, code: str, *, param: str | None = None) -> None:
        await self._send_error(ApiError(400, message, param=param, code=code))

    async def _send_error(self, err: ApiError) -> None:
        with contextlib.suppress(_Closed):
            await self._send(_error_body(err, elevenlabs=self.elevenlabs))

    async def fail(self, err: ApiError) -> None:
        """Tell the client why the session ends, then close it (no isFinal): `close_code`."""
        await self._send_error(err)
        if not self.ws.closed:
            await self.ws.close(code=close_code(err), message=(err.code or "error").encode()[:120])

    async def close(self) -> None:
        """The session is over: abort what it still has in the pipeline."""
        if self._speaker is not None and not self._speaker.done():
            self._speaker.cancel()
            await asyncio.gather(self._speaker, return_exceptions=True)
        if self._encoder is not None:
            self._encoder.close()
        if not self.ws.closed:
            await self.ws.close()


def close_code(err: ApiError) -> int:
    """1008 (policy violation) for what the client did: bad settings, inactivity, a session
    too long; 1011 (internal error) for what the server could not do: a stage failed, the
    model at capacity, not ready."""
    if err.status < 500 and err.status != 429:
        return WSCloseCode.POLICY_VIOLATION
    return WSCloseCode.INTERNAL_ERROR


def _error_body(err: ApiError, *, elevenlabs: bool) -> dict[str, Any]:
    if elevenlabs:  # ElevenLabs' shape; `code` is the close code the error stands for
        return {"message": err.message, "error": err.code or err.type, "code": close_code(err)}
    return {
        "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    }
