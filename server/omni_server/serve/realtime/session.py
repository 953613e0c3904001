"""One Realtime session over one WebSocket: the upgrade, client events in (one table maps each
type to its handler), turns committed and transcribed, responses started and stopped.

Hops of a spoken turn (each streams into the next):
  input_audio_buffer.append -> decode + resample to 16 kHz -> server VAD (Silero, frame by
  frame) -> speech_started / speech_stopped -> committed user item -> the transcription model
  (Whisper) -> the realtime model (thinker -> voice) -> response.output_audio[_transcript].delta

A model that hears audio itself (`audio_input = "native"`) gets the committed turn's clip in
the conversation instead (the item keeps it: conversation.py bounds how many); the
transcription model, when the repository has one, still writes the item's transcript for the
client, beside the response, which does not wait for it.

Every pipeline request of the session is aborted when the socket goes, and a response is
aborted (in every stage, not muted) when the caller speaks over it or sends response.cancel.
Both kinds of pipeline request (a turn's transcription, a response) hold an admission place of
their model while they run, as HTTP requests do (serve/pipeline_call.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from aiohttp import WSMsgType, web

from omni_server.audio.vad import SpeechStarted, Utterance
from omni_server.compiler.plan import ModelSpec, Plan
from omni_server.serve.errors import ApiError
from omni_server.serve.models import loading_models, model_loading
from omni_server.serve.realtime.config import SessionConfig, check_no_tools
from omni_server.serve.realtime.conversation import Conversation, Item, item_from_client
from omni_server.serve.realtime.events import ServerEvents
from omni_server.serve.realtime.input_audio import VAD_RATE, InputAudio, clip_seconds, wav
from omni_server.serve.realtime.protocol import MAX_EVENT_BYTES, ProtocolError
from omni_server.serve.realtime.response_run import ResponseRun
from omni_server.serve.realtime.transcripts import transcribe
from omni_server.serve.state import STATE, ServerState
from omni_server.serve.validation import check_json_text
from omni_server.serve.websocket import BoundedWebSocket

# Events (or their audio) longer than this are parsed and decoded on a worker thread: about
# 1.3 s of PCM16 at 24 kHz in base64, a few milliseconds of the loop's time.
OFF_LOOP_CHARS = 64 << 10
# How long a new response waits for a cancelled one to end (its abort crosses every stage; on a
# loaded machine that is a few hundred milliseconds, not seconds).
CANCEL_WAIT_S = 10.0


async def realtime(request: web.Request) -> web.WebSocketResponse:
    """`GET /v1/realtime?model=...`: upgrade, then run the session until either side closes."""
    state = request.app[STATE]
    model = _realtime_model(state.plan, request.query.get("model"))
    if not state.runtime.ready:
        raise ApiError(503, "the pipeline is not ready", code="unavailable")
    # "realtime": browsers offer it beside the key subprotocol, and need one echoed back
    ws = BoundedWebSocket(max_msg_size=MAX_EVENT_BYTES, heartbeat=30.0, protocols=("realtime",))
    # the place is taken before the upgrade: a client over the bound costs no session (no
    # await between the check and the add, so two connects cannot both take the last place)
    sessions = state.realtime_sessions
    sessions.check_room(
        state.options.max_realtime_sessions,
        what="realtime sessions",
        flag="--max-realtime-sessions",
    )
    beta = request.headers.get("OpenAI-Beta", "").startswith("realtime")
    session = Session(state, model, ws, beta=beta)
    sessions.add(session)
    try:
        await ws.prepare(request)
        await session.run()
    finally:
        try:
            await session.close()
        finally:
            sessions.discard(session)
    return ws


def _parsed(data: str) -> Any:
    """A client event as JSON, every string in it text a codec can carry: a lone surrogate in
    an item, the instructions or any session field is refused with the event (ApiError 400,
    naming its place), as HTTP refuses it, never failing a response later in a stage."""
    event = json.loads(data)
    check_json_text(event)
    return event


def _realtime_model(plan: Plan, name: str | None) -> ModelSpec:
    models = [m for m in plan.models.values() if "realtime" in m.tasks]
    if not models and name is None:  # the default model may be one being loaded
        name = next((m.id for m in loading_models(plan) if "realtime" in m.tasks), None)
    if not models:
        if name is not None and (loading := model_loading(plan, name)) is not None:
            raise loading
        raise ApiError(
            404, "no model of this repository serves the realtime task", code="not_found"
        )
    if name is None:
        return models[0]
    for model in models:
        if name == model.id or name in model.aliases:
            return model
    if (loading := model_loading(plan, name)) is not None:
        raise loading
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
        self.events = ServerEvents(ws, beta=beta)
        self.ids = self.events.ids
        self.id = self.ids.new("sess")
        voice = model.default_voice or (model.voices[0] if model.voices else "")
        self.config = SessionConfig(model=model.id, voice=voice)
        # A session starts with the model's defaults (its entry stage's [sampling]) where it
        # declares them, as a chat request that leaves the fields out: GA sessions carry no
        # temperature, and OpenAI's 0.8 makes a small model ramble.
        if model.sampling.temperature is not None:
            self.config.temperature = model.sampling.temperature
        if model.sampling.max_tokens is not None:
            self.config.max_output_tokens = model.sampling.max_tokens
        options = state.options
        self.conversation = Conversation(
            max_item_chars=options.max_realtime_item_chars,
            max_chars=options.max_realtime_conversation_chars,
        )
        self._asr = _task_model(state.plan, "transcription")
        self._text_model = _text_model(state.plan, model)
        self._response: ResponseRun | None = None
        self._last_response: str | None = None  # the newest ended response that was created
        self._transcripts: dict[str, asyncio.Task[None]] = {}  # item id -> its transcription
        self._tasks: set[asyncio.Task[Any]] = set()
        self._input = InputAudio(self.config)

    @property
    def input_audio(self) -> InputAudio:
        """The uncommitted audio and its detector (replaced by a new format or detector)."""
        return self._input

    def held_bytes(self) -> int:
        """What the session holds between events, at most: its conversation's characters (4
        bytes each at worst), the clips of spoken turns its model hears, and its uncommitted
        audio. Each is bounded (docs/realtime.md)."""
        return 4 * self.conversation.chars() + self.conversation.clip_bytes() + self._input.nbytes

    # ---- the socket ------------------------------------------------------------------------

    async def run(self) -> None:
        await self.events.send({"type": "session.created", "session": self._session_view()})
        async for message in self.ws:
            if message.type == WSMsgType.TEXT:
                await self._receive(message.data)
            elif message.type == WSMsgType.BINARY:
                await self.events.send(
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

    async def _receive(self, data: str) -> None:
        try:
            # a big event (up to 16 MiB) is parsed off the event loop: other sessions and
            # HTTP requests go on meanwhile; this session's events stay in order (one at a time)
            event = (
                await asyncio.to_thread(_parsed, data)
                if len(data) > OFF_LOOP_CHARS
                else _parsed(data)
            )
        except (json.JSONDecodeError, RecursionError):
            await self.events.send(
                ProtocolError("the event is not valid JSON", code="invalid_json").event()
            )
            return
        except ApiError as err:  # text no codec can carry (a lone surrogate): refused whole
            await self.events.send(ProtocolError(err.message, param=err.param).event())
            return
        event_id = event.get("event_id") if isinstance(event, dict) else None
        kind = event.get("type") if isinstance(event, dict) else None
        try:
            handler = HANDLERS.get(kind) if isinstance(kind, str) else None
            if handler is None:
                raise ProtocolError(
                    f"unknown event type {kind!r}", code="invalid_event", param="type"
                )
            await handler(self, event)
        except ProtocolError as err:
            err.event_id = err.event_id or event_id
            await self.events.send(err.event())

    # ---- session ---------------------------------------------------------------------------

    async def _on_session_update(self, event: dict[str, Any]) -> None:
        voices = tuple(self.state.voices.names(self.model))  # declared, aliases, custom ids
        before = (self.config.input_format, self.config.turn_detection)
        self.config.update(event.get("session"), voices)
        self.config.voice = self.model.voice_aliases.get(self.config.voice, self.config.voice)
        if (self.config.input_format, self.config.turn_detection) != before:
            self._input = InputAudio(self.config)  # a new format or detector: a fresh buffer
        await self.events.send({"type": "session.updated", "session": self._session_view()})

    def _session_view(self) -> dict[str, Any]:
        return self.config.beta(self.id) if self.beta else self.config.ga(self.id)

    # ---- input audio and turns -------------------------------------------------------------

    async def _on_input_audio_buffer_append(self, event: dict[str, Any]) -> None:
        raw, buffer = event.get("audio"), self._input
        if isinstance(raw, str) and len(raw) > OFF_LOOP_CHARS:
            # base64, resampling and VAD over seconds of audio run on a worker thread, so the
            # loop keeps serving; the session awaits it, so nothing else touches `buffer`
            heard = await asyncio.to_thread(buffer.append, raw)
        else:
            heard = buffer.append(raw)  # a microphone's 20-100 ms: cheaper than a thread hop
        for found in heard:
            await self._on_vad(found)

    async def _on_vad(self, found: SpeechStarted | Utterance) -> None:
        td = self.config.turn_detection
        assert td is not None  # only a session with turn detection has a detector
        if isinstance(found, SpeechStarted):
            self._input.speech_item = self.ids.new("item")
            start_ms = max(0, round(found.at * 1000) - td.prefix_padding_ms)
            await self.events.send(
                {
                    "type": "input_audio_buffer.speech_started",
                    "audio_start_ms": start_ms,
                    "item_id": self._input.speech_item,
                }
            )
            if td.interrupt_response and self._response is not None:
                await self._response.cancel("turn_detected")  # barge-in
            return
        item_id = self._input.speech_item or self.ids.new("item")
        self._input.speech_item = None
        await self.events.send(
            {
                "type": "input_audio_buffer.speech_stopped",
                "audio_end_ms": round(found.end * 1000),
                "item_id": item_id,
            }
        )
        await self._commit(item_id, self._input.take(found))
        if td.create_response:
            await self._start_response({}, event_id=None)

    async def _on_input_audio_buffer_commit(self, event: dict[str, Any]) -> None:
        clip = self._input.take_all()
        item_id = self._input.speech_item or self.ids.new("item")
        self._input.speech_item = None
        await self._commit(item_id, clip)

    async def _on_input_audio_buffer_clear(self, event: dict[str, Any]) -> None:
        self._input.clear()
        await self.events.send({"type": "input_audio_buffer.cleared"})

    async def _commit(self, item_id: str, clip: np.ndarray) -> None:
        """A user turn: the committed item, then its transcript (the thinker's input, or, for a
        model that hears the clip, the client's alone)."""
        item = Item(id=item_id, role="user", content=[{"type": "input_audio", "transcript": None}])
        if self.model.hears_audio:
            item.clip = wav(clip)
        previous = self.conversation.add(item)
        await self.events.send(
            {
                "type": "input_audio_buffer.committed",
                "item_id": item_id,
                "previous_item_id": previous,
            }
        )
        await self.events.item_added(item, previous)
        if self.model.hears_audio and not self.config.transcription:
            return  # the model hears the clip and the client asked for no transcript
        self._transcribe(item, item.clip or wav(clip), clip.size / VAD_RATE)

    def _transcribe(self, item: Item, clip: bytes, seconds: float, index: int = 0) -> None:
        """Start the transcript of the item's clip (part `index`), when the repository has a
        transcription model; a cascade's next response waits for it (`_transcripts`)."""
        if self._asr is None:
            return
        task = asyncio.get_running_loop().create_task(
            transcribe(self.state, self._asr, self.events, self.config, item, clip, seconds, index)
        )
        self._transcripts[item.id] = task
        task.add_done_callback(lambda _: self._transcripts.pop(item.id, None))

    # ---- conversation ----------------------------------------------------------------------

    async def _on_conversation_item_create(self, event: dict[str, Any]) -> None:
        raw = event.get("item")
        item_id = (
            raw.get("id") if isinstance(raw, dict) and isinstance(raw.get("id"), str) else None
        )
        item_id = item_id or self.ids.new("item")
        if self.model.hears_audio:  # a user item may hold audio: decoded off the event loop
            hears = self.config.input_format
            item = await asyncio.to_thread(item_from_client, raw, item_id, hears)
        else:
            item = item_from_client(raw, item_id)
        previous = self.conversation.add_from_client(item, event.get("previous_item_id"))
        await self.events.item_added(item, previous)
        if item.clip is not None and self.config.transcription:
            index = next(i for i, p in enumerate(item.content) if p["type"] == "input_audio")
            if item.content[index]["transcript"] is None:  # else the client's own
                self._transcribe(item, item.clip, clip_seconds(item.clip), index)

    async def _on_conversation_item_delete(self, event: dict[str, Any]) -> None:
        item_id = str(event.get("item_id"))
        self.conversation.delete(item_id)
        await self.events.send({"type": "conversation.item.deleted", "item_id": item_id})

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
        await self.events.send(
            {
                "type": "conversation.item.truncated",
                "item_id": item_id,
                "content_index": index,
                "audio_end_ms": end,
            }
        )

    async def _on_conversation_item_retrieve(self, event: dict[str, Any]) -> None:
        item = self.conversation.get(str(event.get("item_id")))
        await self.events.send(
            {"type": "conversation.item.retrieved", "item": self.events.item_view(item)}
        )

    # ---- responses -------------------------------------------------------------------------

    async def _on_response_create(self, event: dict[str, Any]) -> None:
        overrides = event.get("response") or {}
        if not isinstance(overrides, dict):
            raise ProtocolError("response must be an object", param="response")
        check_no_tools(overrides, "response")
        await self._start_response(overrides, event_id=event.get("event_id"))

    async def _on_response_cancel(self, event: dict[str, Any]) -> None:
        if self._response is None:
            raise ProtocolError("no response is in progress", code="response_cancel_not_active")
        await self._response.cancel("client_cancelled")

    async def _on_output_audio_buffer_clear(self, event: dict[str, Any]) -> None:
        """WebRTC's playback buffer; over a WebSocket the client holds it: stop the answer, and
        say so with `output_audio_buffer.cleared` naming the response whose audio it was (the
        newest one: a client may still be playing it after its `response.done`)."""
        running = self._response
        response_id = running.id if running is not None and running.created else self._last_response
        if response_id is None:
            raise ProtocolError(
                "no response has produced audio to clear", code="output_audio_buffer_empty"
            )
        if running is not None:
            await running.cancel("client_cancelled")
        await self.events.send({"type": "output_audio_buffer.cleared", "response_id": response_id})

    async def _start_response(self, overrides: dict[str, Any], *, event_id: Any) -> None:
        running = self._response
        if running is not None and running.cancelling:
            # A barge-in (or response.cancel) asked it to stop and its abort is still going
            # through the stages: the turn's own response (or the client's next) waits for that
            # response's `response.done` instead of being refused for it. Bounded: a run that
            # does not end within the bound leaves the refusal below to say so.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(running.ended(), CANCEL_WAIT_S)
        if self._response is not None:
            raise ProtocolError(
                "a response is in progress; cancel it first",
                code="conversation_already_has_active_response",
            )
        modalities = overrides.get("output_modalities", overrides.get("modalities"))
        config = self.config
        if modalities is not None or "instructions" in overrides:
            config = copy.deepcopy(config)
            config.update(
                {
                    k: v
                    for k, v in overrides.items()
                    if k in ("instructions", "output_modalities", "modalities")
                },
                (config.voice,),
            )
        # a text-only answer needs no voice: the chat model ending at the same thinker
        model = self.model if "audio" in config.output_modalities else self._text_model
        response = ResponseRun(
            self.state,
            self.events,
            self.conversation,
            model=model,
            config=config,
            session_id=self.id,
            # a model that hears the turns needs no transcript first
            waits=[] if model.hears_audio else list(self._transcripts.values()),
            event_id=event_id if isinstance(event_id, str) else None,
            on_end=self._response_ended,
        )
        self._response = response
        task = asyncio.get_running_loop().create_task(response.run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _response_ended(self, response: ResponseRun) -> None:
        if response.created:  # a refused response never reached the client: not its audio
            self._last_response = response.id
        if self._response is response:
            self._response = None


# Client event type -> its handler: the events this server takes, in GA names (each generation's
# client events are named alike). Any other type is an `error` event naming it.
Handler = Callable[[Session, dict[str, Any]], Awaitable[None]]
HANDLERS: dict[str, Handler] = {
    "session.update": Session._on_session_update,
    "input_audio_buffer.append": Session._on_input_audio_buffer_append,
    "input_audio_buffer.commit": Session._on_input_audio_buffer_commit,
    "input_audio_buffer.clear": Session._on_input_audio_buffer_clear,
    "conversation.item.create": Session._on_conversation_item_create,
    "conversation.item.delete": Session._on_conversation_item_delete,
    "conversation.item.truncate": Session._on_conversation_item_truncate,
    "conversation.item.retrieve": Session._on_conversation_item_retrieve,
    "response.create": Session._on_response_create,
    "response.cancel": Session._on_response_cancel,
    "output_audio_buffer.clear": Session._on_output_audio_buffer_clear,
}


def _task_model(plan: Plan, task: str) -> ModelSpec | None:
    return next((m for m in plan.models.values() if task in m.tasks), None)


def _text_model(plan: Plan, model: ModelSpec) -> ModelSpec:
    """For text-only answers: a chat model that ends at the same thinker (no voice stages) and
    hears audio as this one does; else this model (its answer's `speech` is None)."""
    for other in plan.models.values():
        if (
            "chat" in other.tasks
            and other.entry == model.entry
            and not other.voices
            and other.audio_input == model.audio_input
        ):
            return other
    return model
