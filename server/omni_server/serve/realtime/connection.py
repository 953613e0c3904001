"""One Realtime session over one WebSocket: events in, the turn loop, events out.

Hops of a spoken turn (each streams into the next):
  input_audio_buffer.append -> decode + resample to 16 kHz -> server VAD (Silero, frame by
  frame) -> speech_started / speech_stopped -> committed user item -> the transcription model
  (Whisper) -> the realtime model (thinker -> voice) -> response.output_audio[_transcript].delta

Every pipeline request of the session is aborted when the socket goes, and a response is
aborted (in every stage, not muted) when the caller speaks over it or sends response.cancel.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import io
import json
import logging
import wave
from typing import Any

import numpy as np
from aiohttp import WSMsgType, web

from omni_server.audio.resample import StreamResampler
from omni_server.audio.vad import (
    SegmenterOptions,
    SileroStream,
    SileroVad,
    SpeechStarted,
    Utterance,
    UtteranceTracker,
)
from omni_server.compiler.plan import ModelSpec, Plan
from omni_server.pipeline import PipelineError
from omni_server.serve.errors import ApiError
from omni_server.serve.realtime import audio
from omni_server.serve.realtime.config import SessionConfig
from omni_server.serve.realtime.conversation import Conversation, Item, item_from_client
from omni_server.serve.realtime.protocol import (
    BETA_NAMES,
    BETA_PARTS,
    CLIENT_EVENTS,
    MAX_EVENT_BYTES,
    Ids,
    ProtocolError,
)
from omni_server.serve.state import STATE, ServerState
from omni_server.serve.transcription_request import asr_inputs

log = logging.getLogger(__name__)

VAD_RATE = 16_000
MAX_BUFFER_S = 120.0  # uncommitted input audio kept at most (older audio is dropped)


async def realtime(request: web.Request) -> web.WebSocketResponse:
    """`GET /v1/realtime?model=...`: upgrade, then run the session until either side closes."""
    state = request.app[STATE]
    model = _realtime_model(state.plan, request.query.get("model"))
    if not state.runtime.ready:
        raise ApiError(503, "the pipeline is not ready", code="unavailable")
    # "realtime": browsers offer it beside the key subprotocol, and need one echoed back
    ws = web.WebSocketResponse(
        max_msg_size=MAX_EVENT_BYTES, heartbeat=30.0, protocols=("realtime",)
    )
    await ws.prepare(request)
    beta = request.headers.get("OpenAI-Beta", "").startswith("realtime")
    session = Session(state, model, ws, beta=beta)
    try:
        await session.run()
    finally:
        await session.close()
    return ws


def _realtime_model(plan: Plan, name: str | None) -> ModelSpec:
    models = [m for m in plan.models.values() if "realtime" in m.tasks]
    if not models:
        raise ApiError(
            404, "no model of this repository serves the realtime task", code="not_found"
        )
    if name is None:
        return models[0]
    for model in models:
        if name == model.id or name in model.aliases:
            return model
    raise ApiError(
        404,
        f"no realtime model {name!r}; realtime models: {', '.join(m.id for m in models)}",
        param="model",
        code="model_not_found",
    )


class Session:
    def __init__(
        self, state: ServerState, model: ModelSpec, ws: web.WebSocketResponse, *, beta: bool
    ) -> None:
        self.state, self.model, self.ws, self.beta = state, model, ws, beta
        self.ids = Ids()
        self.id = self.ids.new("sess")
        voice = model.default_voice or (model.voices[0] if model.voices else "")
        self.config = SessionConfig(model=model.id, voice=voice)
        self.conversation = Conversation()
        self._asr = _task_model(state.plan, "transcription")
        self._text_model = _text_model(state.plan, model)
        self._response: Response | None = None
        self._transcripts: dict[str, asyncio.Task[None]] = {}  # item id -> its transcription
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reset_input()

    # ---- the socket ------------------------------------------------------------------------

    async def run(self) -> None:
        await self.send({"type": "session.created", "session": self._session_view()})
        async for message in self.ws:
            if message.type == WSMsgType.TEXT:
                await self._receive(message.data)
            elif message.type == WSMsgType.BINARY:
                await self.send(
                    ProtocolError("events are JSON text frames", code="invalid_event").event()
                )
            elif message.type == WSMsgType.ERROR:
                break

    async def close(self) -> None:
        """The socket is gone: abort everything of this session in every stage."""
        if self._response is not None:
            await self._response.cancel("client_disconnected", notify=False)
        for task in [*self._tasks, *self._transcripts.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._transcripts.values(), return_exceptions=True)

    async def send(self, event: dict[str, Any]) -> None:
        if self.ws.closed:
            return
        event = {"event_id": self.ids.new("event"), **event}
        if self.beta:
            event["type"] = BETA_NAMES.get(event["type"], event["type"])
            _beta_parts(event)
        await self.ws.send_str(json.dumps(event))

    async def _receive(self, data: str) -> None:
        try:
            event = json.loads(data)
        except (json.JSONDecodeError, RecursionError):
            await self.send(
                ProtocolError("the event is not valid JSON", code="invalid_json").event()
            )
            return
        event_id = event.get("event_id") if isinstance(event, dict) else None
        kind = event.get("type") if isinstance(event, dict) else None
        try:
            if kind not in CLIENT_EVENTS:
                raise ProtocolError(
                    f"unknown event type {kind!r}", code="invalid_event", param="type"
                )
            await getattr(self, "_on_" + kind.replace(".", "_"))(event)
        except ProtocolError as err:
            err.event_id = err.event_id or event_id
            await self.send(err.event())

    # ---- session ---------------------------------------------------------------------------

    async def _on_session_update(self, event: dict[str, Any]) -> None:
        voices = (*self.model.voices, *self.model.voice_aliases)
        before = (self.config.input_format, self.config.turn_detection)
        self.config.update(event.get("session"), voices)
        self.config.voice = self.model.voice_aliases.get(self.config.voice, self.config.voice)
        if (self.config.input_format, self.config.turn_detection) != before:
            self._reset_input()  # a new format or detector starts a fresh buffer
        await self.send({"type": "session.updated", "session": self._session_view()})

    def _session_view(self) -> dict[str, Any]:
        return self.config.beta(self.id) if self.beta else self.config.ga(self.id)

    # ---- input audio -----------------------------------------------------------------------

    def _reset_input(self) -> None:
        td = self.config.turn_detection
        self._resampler = StreamResampler(self.config.input_format.rate, VAD_RATE)
        self._pending = np.zeros(0, np.float32)  # uncommitted audio at 16 kHz
        self._pending_start_s = 0.0  # where _pending starts on the input timeline
        self._heard_s = 0.0  # input audio received, seconds
        self._speech_item: str | None = None  # the item id a detected speech will commit as
        self._vad: SileroStream | None = None
        self._tracker: UtteranceTracker | None = None
        if td is not None:
            self._vad = SileroVad().stream()
            options = SegmenterOptions(
                threshold=td.threshold,
                min_silence_s=td.silence_duration_ms / 1000,
                pad_s=td.prefix_padding_ms / 1000,
            )
            frame_s = SileroVad.frame_samples / VAD_RATE
            self._tracker = UtteranceTracker(frame_s, options)

    async def _on_input_audio_buffer_append(self, event: dict[str, Any]) -> None:
        raw = event.get("audio")
        if not isinstance(raw, str):
            raise ProtocolError("audio must be a base64 string", param="audio")
        try:
            data = base64.b64decode(raw, validate=True)
            samples = audio.decode(data, self.config.input_format)
        except (binascii.Error, ValueError) as err:
            raise ProtocolError(
                f"audio is not base64 {self.config.input_format.type}: {err}",
                code="invalid_audio",
                param="audio",
            ) from None
        heard = self._resampler.push(samples)
        self._pending = np.concatenate([self._pending, heard])
        self._heard_s += samples.size / self.config.input_format.rate
        overflow = self._pending.size - int(MAX_BUFFER_S * VAD_RATE)
        if overflow > 0:
            self._pending = self._pending[overflow:]
            self._pending_start_s += overflow / VAD_RATE
        if self._vad is not None and self._tracker is not None:
            for probability in self._vad.push(heard):
                for found in self._tracker.push(float(probability)):
                    await self._on_vad(found)

    async def _on_vad(self, found: SpeechStarted | Utterance) -> None:
        td = self.config.turn_detection
        assert td is not None
        if isinstance(found, SpeechStarted):
            self._speech_item = self.ids.new("item")
            start_ms = max(0, round(found.at * 1000) - td.prefix_padding_ms)
            await self.send(
                {
                    "type": "input_audio_buffer.speech_started",
                    "audio_start_ms": start_ms,
                    "item_id": self._speech_item,
                }
            )
            if td.interrupt_response and self._response is not None:
                await self._response.cancel("turn_detected")  # barge-in
            return
        item_id = self._speech_item or self.ids.new("item")
        self._speech_item = None
        await self.send(
            {
                "type": "input_audio_buffer.speech_stopped",
                "audio_end_ms": round(found.end * 1000),
                "item_id": item_id,
            }
        )
        start = max(0, round((found.start - self._pending_start_s) * VAD_RATE))
        end = max(start, round((found.end - self._pending_start_s) * VAD_RATE))
        clip = self._pending[start:end]
        self._pending = self._pending[end:]
        self._pending_start_s += end / VAD_RATE
        await self._commit(item_id, clip)
        if td.create_response:
            await self._start_response({})

    async def _on_input_audio_buffer_commit(self, event: dict[str, Any]) -> None:
        if self._pending.size < VAD_RATE // 10:
            raise ProtocolError(
                "the input audio buffer holds less than 100 ms of audio",
                code="input_audio_buffer_commit_empty",
            )
        clip, item_id = self._pending, self._speech_item or self.ids.new("item")
        self._pending_start_s += clip.size / VAD_RATE
        self._pending = np.zeros(0, np.float32)
        self._speech_item = None
        await self._commit(item_id, clip)

    async def _on_input_audio_buffer_clear(self, event: dict[str, Any]) -> None:
        self._pending_start_s += self._pending.size / VAD_RATE
        self._pending = np.zeros(0, np.float32)
        await self.send({"type": "input_audio_buffer.cleared"})

    async def _commit(self, item_id: str, clip: np.ndarray) -> None:
        """A user turn: the committed item, then its transcript (the thinker's input)."""
        item = Item(id=item_id, role="user", content=[{"type": "input_audio", "transcript": None}])
        previous = self.conversation.add(item)
        await self.send(
            {
                "type": "input_audio_buffer.committed",
                "item_id": item_id,
                "previous_item_id": previous,
            }
        )
        await self._item_added(item, previous)
        task = asyncio.get_running_loop().create_task(self._transcribe(item, clip))
        self._transcripts[item.id] = task
        task.add_done_callback(lambda _: self._transcripts.pop(item.id, None))

    async def _transcribe(self, item: Item, clip: np.ndarray) -> None:
        if self._asr is None:
            return
        handle = self.state.runtime.submit(self._asr, asr_inputs(_wav(clip, VAD_RATE)))
        async with handle:
            try:
                result = await handle.result()
            except PipelineError as err:
                if self.config.transcription:
                    await self.send(
                        {
                            "type": "conversation.item.input_audio_transcription.failed",
                            "item_id": item.id,
                            "content_index": 0,
                            "error": {"type": "transcription_error", "message": err.message},
                        }
                    )
                return
        text = str(result.get("text", "")).strip() if isinstance(result, dict) else ""
        item.content[0]["transcript"] = text
        if self.config.transcription:
            common = {"item_id": item.id, "content_index": 0}
            await self.send(
                {
                    "type": "conversation.item.input_audio_transcription.delta",
                    **common,
                    "delta": text,
                }
            )
            await self.send(
                {
                    "type": "conversation.item.input_audio_transcription.completed",
                    **common,
                    "transcript": text,
                    "usage": {"type": "duration", "seconds": round(clip.size / VAD_RATE, 3)},
                }
            )

    # ---- conversation ----------------------------------------------------------------------

    async def _on_conversation_item_create(self, event: dict[str, Any]) -> None:
        raw = event.get("item")
        item_id = (
            raw.get("id") if isinstance(raw, dict) and isinstance(raw.get("id"), str) else None
        )
        item = item_from_client(raw, item_id or self.ids.new("item"))
        previous = self.conversation.add(item, event.get("previous_item_id"))
        await self._item_added(item, previous)

    async def _on_conversation_item_delete(self, event: dict[str, Any]) -> None:
        item_id = str(event.get("item_id"))
        self.conversation.delete(item_id)
        await self.send({"type": "conversation.item.deleted", "item_id": item_id})

    async def _on_conversation_item_truncate(self, event: dict[str, Any]) -> None:
        item_id, index, end = (
            event.get("item_id"),
            event.get("content_index", 0),
            event.get("audio_end_ms"),
        )
        if not isinstance(index, int) or not isinstance(end, int):
            raise ProtocolError(
                "content_index and audio_end_ms must be integers", param="audio_end_ms"
            )
        self.conversation.truncate(str(item_id), index, end)
        await self.send(
            {
                "type": "conversation.item.truncated",
                "item_id": item_id,
                "content_index": index,
                "audio_end_ms": end,
            }
        )

    async def _on_conversation_item_retrieve(self, event: dict[str, Any]) -> None:
        item = self.conversation.get(str(event.get("item_id")))
        await self.send({"type": "conversation.item.retrieved", "item": self._item_view(item)})

    async def _item_added(self, item: Item, previous: str | None) -> None:
        view = self._item_view(item)
        await self.send(
            {"type": "conversation.item.added", "item": view, "previous_item_id": previous}
        )
        if not self.beta and item.status == "completed":
            await self.send(
                {"type": "conversation.item.done", "item": view, "previous_item_id": previous}
            )

    def _item_view(self, item: Item) -> dict[str, Any]:
        return item.beta() if self.beta else item.ga()

    # ---- responses -------------------------------------------------------------------------

    async def _on_response_create(self, event: dict[str, Any]) -> None:
        overrides = event.get("response") or {}
        if not isinstance(overrides, dict):
            raise ProtocolError("response must be an object", param="response")
        await self._start_response(overrides)

    async def _on_response_cancel(self, event: dict[str, Any]) -> None:
        if self._response is None:
            raise ProtocolError("no response is in progress", code="response_cancel_not_active")
        await self._response.cancel("client_cancelled")

    async def _on_output_audio_buffer_clear(self, event: dict[str, Any]) -> None:
        """WebRTC's playback buffer; over a WebSocket the client holds it: stop the answer."""
        if self._response is not None:
            await self._response.cancel("client_cancelled")

    async def _start_response(self, overrides: dict[str, Any]) -> None:
        if self._response is not None:
            raise ProtocolError(
                "a response is in progress; cancel it first",
                code="conversation_already_has_active_response",
            )
        modalities = overrides.get("output_modalities", overrides.get("modalities"))
        config = self.config
        if modalities is not None or "instructions" in overrides:
            config = _copy_config(config)
            config.update(
                {
                    k: v
                    for k, v in overrides.items()
                    if k in ("instructions", "output_modalities", "modalities")
                },
                (config.voice,),
            )
        response = Response(self, config, list(self._transcripts.values()))
        self._response = response
        task = asyncio.get_running_loop().create_task(response.run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _response_ended(self, response: Response) -> None:
        if self._response is response:
            self._response = None


class Response:
    """One answer: the thinker's text streamed as transcript (or text), the voice's audio."""

    def __init__(
        self, session: Session, config: SessionConfig, waits: list[asyncio.Task[None]]
    ) -> None:
        self.session, self.config, self._waits = session, config, waits
        self.id = session.ids.new("resp")
        self.audio = "audio" in config.output_modalities
        self.item = Item(
            id=session.ids.new("item"),
            role="assistant",
            status="in_progress",
            content=[
                {"type": "output_audio", "transcript": ""}
                if self.audio
                else {"type": "output_text", "text": ""}
            ],
        )
        self._handle: Any = None
        self._cancelled: str | None = None
        self._usage = {"input_tokens": 0, "output_tokens": 0}

    def _view(self, status: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
        out_format = self.config.output_format
        view: dict[str, Any] = {
            "object": "realtime.response",
            "id": self.id,
            "status": status,
            "status_details": details,
            "output": [self.session._item_view(self.item)] if status != "in_progress" else [],
            "conversation_id": f"conv_{self.session.id}",
            "output_modalities": list(self.config.output_modalities),
            "max_output_tokens": self.config.max_output_tokens or "inf",
            "audio": {"output": {"format": out_format.ga(), "voice": self.config.voice}},
        }
        if status != "in_progress":
            total = self._usage["input_tokens"] + self._usage["output_tokens"]
            view["usage"] = {**self._usage, "total_tokens": total}
        return view

    async def run(self) -> None:
        session = self.session
        where = {
            "response_id": self.id,
            "item_id": self.item.id,
            "output_index": 0,
            "content_index": 0,
        }
        status: str = "completed"
        details: dict[str, Any] | None = None
        try:
            await session.send({"type": "response.created", "response": self._view("in_progress")})
            if self._waits:  # the turn's transcript is the thinker's input
                await asyncio.gather(*self._waits, return_exceptions=True)
            previous = session.conversation.add(self.item)
            view = session._item_view(self.item)
            await session.send(
                {
                    "type": "response.output_item.added",
                    "response_id": self.id,
                    "output_index": 0,
                    "item": view,
                }
            )
            await session._item_added(self.item, previous)
            part = self.item.content[0]
            await session.send({"type": "response.content_part.added", **where, "part": dict(part)})
            await self._stream(where, part)
            if self._cancelled is not None:
                status, details = "cancelled", {"type": "cancelled", "reason": self._cancelled}
        except PipelineError as err:
            if self._cancelled is not None:  # our own abort ended the pipeline request
                status, details = "cancelled", {"type": "cancelled", "reason": self._cancelled}
            else:
                status = "failed"
                error: dict[str, Any] = {
                    "type": "server_error",
                    "code": err.code,
                    "message": err.message,
                }
                details = {"type": "failed", "error": error}
                await session.send({"type": "error", "error": {**error, "param": None}})
        finally:
            session._response_ended(self)
        self.item.status = "completed" if status == "completed" else "incomplete"
        part = self.item.content[0]
        if self.audio:
            await session.send({"type": "response.output_audio.done", **where})
            await session.send(
                {
                    "type": "response.output_audio_transcript.done",
                    **where,
                    "transcript": part["transcript"],
                }
            )
        else:
            await session.send({"type": "response.output_text.done", **where, "text": part["text"]})
        await session.send({"type": "response.content_part.done", **where, "part": dict(part)})
        view = session._item_view(self.item)
        await session.send(
            {
                "type": "response.output_item.done",
                "response_id": self.id,
                "output_index": 0,
                "item": view,
            }
        )
        if not session.beta:
            await session.send({"type": "conversation.item.done", "item": view})
        await session.send({"type": "response.done", "response": self._view(status, details)})

    async def _stream(self, where: dict[str, Any], part: dict[str, Any]) -> None:
        session, config = self.session, self.config
        messages = session.conversation.messages(config.instructions)
        inputs: dict[str, Any] = {
            "messages": messages[:-1]
            if messages and messages[-1]["role"] == "assistant"
            else messages,
            "max_tokens": config.max_output_tokens,
            "temperature": config.temperature,
            "top_p": 1.0,
            "seed": None,
            "stop": [],
            "speech": None,
        }
        model = session.model
        if self.audio:
            inputs["speech"] = {
                "voice": config.voice,
                "speed": config.speed,
                "seed": None,
                "response_format": "pcm",
                "stream": True,
                "sample_rate": None,
            }
        else:
            model = session._text_model
        encoder = audio.Encoder(config.output_format)
        if self._cancelled is not None:
            return
        self._handle = session.state.runtime.submit(model, inputs)
        async with self._handle:
            async for _, chunk in self._handle.stream():
                if chunk.get("text"):
                    key = "transcript" if self.audio else "text"
                    part[key] += chunk["text"]
                    kind = (
                        "response.output_audio_transcript.delta"
                        if self.audio
                        else "response.output_text.delta"
                    )
                    await session.send({"type": kind, **where, "delta": chunk["text"]})
                if self.audio and chunk.get("audio"):
                    await self._audio(where, encoder.encode(bytes(chunk["audio"])))
            if self.audio:
                await self._audio(where, encoder.flush())
            result = await self._handle.result()
        for payload in (
            result.values() if isinstance(result, dict) and "usage" not in result else [result]
        ):
            if isinstance(payload, dict) and isinstance(payload.get("usage"), dict):
                self._usage = {
                    "input_tokens": int(payload["usage"].get("prompt_tokens", 0)),
                    "output_tokens": int(payload["usage"].get("completion_tokens", 0)),
                }

    async def _audio(self, where: dict[str, Any], data: bytes) -> None:
        if not data:
            return
        self.item.audio_ms += 1000 * len(data) / self.config.output_format.bytes_per_second()
        await self.session.send(
            {
                "type": "response.output_audio.delta",
                **where,
                "delta": base64.b64encode(data).decode(),
            }
        )

    async def cancel(self, reason: str, *, notify: bool = True) -> None:
        """Stop the answer in every stage (abort, not mute); run() then reports it cancelled."""
        if self._cancelled is not None:
            return
        self._cancelled = reason
        if self._handle is not None:
            await self._handle.abort()
        if not notify:
            self.session._response_ended(self)


def _task_model(plan: Plan, task: str) -> ModelSpec | None:
    return next((m for m in plan.models.values() if task in m.tasks), None)


def _text_model(plan: Plan, model: ModelSpec) -> ModelSpec:
    """For text-only answers: a chat model that ends at the same thinker (no voice stages)."""
    for other in plan.models.values():
        if "chat" in other.tasks and other.entry == model.entry and not other.voices:
            return other
    return model


def _copy_config(config: SessionConfig) -> SessionConfig:
    return copy.deepcopy(config)


def _wav(samples: np.ndarray, rate: int) -> bytes:
    pcm = (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes()
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
    return out.getvalue()


def _beta_parts(event: dict[str, Any]) -> None:
    """Beta names for content part types, wherever a part rides the event."""
    part = event.get("part")
    if isinstance(part, dict) and part.get("type") in BETA_PARTS:
        event["part"] = {**part, "type": BETA_PARTS[part["type"]]}
