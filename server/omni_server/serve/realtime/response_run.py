"""One realtime response: an admission place, the conversation to the realtime model, and its
answer streamed back as transcript (or text) and audio deltas, then the `.done` events.

A response takes its place of the model at once or not at all (`admitted(wait=False)`): with
none free the client gets an `error` event (`rate_limit_exceeded`, as HTTP's 429) and no
response runs. An admitted response holds its place, counted in the in-pipeline gauge, from
`response.created` until its pipeline request has ended, before its `.done` events go out.
`cancel` aborts the pipeline request in every stage (barge-in, `response.cancel`, the socket
gone); the run then reports the response cancelled. After `response.done` comes OpenAI's
`rate_limits.updated` (OpenAI's servers send it there): this server's one limit, the model's
admission places (`requests`: `--max-in-flight`, and how many are free now).
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from typing import Any

from omni_server.compiler.plan import ModelSpec
from omni_server.contracts import ChatInput, Message, Sampling, SpeechOptions, SpeechTiming
from omni_server.pipeline import PipelineError, RequestHandle
from omni_server.serve.errors import ApiError
from omni_server.serve.pipeline_call import admitted, submitted
from omni_server.serve.realtime import audio
from omni_server.serve.realtime.config import SessionConfig
from omni_server.serve.realtime.conversation import Conversation, Item
from omni_server.serve.realtime.events import ServerEvents
from omni_server.serve.state import ServerState
from omni_server.serve.timing_formats import chunk_timing, words_ms

Outcome = tuple[str, dict[str, Any] | None]  # the response's status and its status_details


class ResponseRun:
    """One answer: the thinker's text streamed as transcript (or text), the voice's audio."""

    def __init__(
        self,
        state: ServerState,
        events: ServerEvents,
        conversation: Conversation,
        *,
        model: ModelSpec,
        config: SessionConfig,
        session_id: str,
        waits: list[asyncio.Task[None]],
        event_id: str | None,
        on_end: Callable[[ResponseRun], None],
    ) -> None:
        """`waits`: the transcriptions the answer must read first; `event_id`: the client's
        `response.create`, named by a refusal; `on_end`: called once the run holds nothing."""
        self.state, self.events, self.conversation = state, events, conversation
        self.model, self.config, self.session_id = model, config, session_id
        self._waits, self._event_id, self._on_end = waits, event_id, on_end
        self.id = events.ids.new("resp")
        self.audio = "audio" in config.output_modalities
        self.item = Item(
            id=events.ids.new("item"),
            role="assistant",
            status="in_progress",
            content=[
                {"type": "output_audio", "transcript": ""}
                if self.audio
                else {"type": "output_text", "text": ""}
            ],
        )
        self._where = {
            "response_id": self.id,
            "item_id": self.item.id,
            "output_index": 0,
            "content_index": 0,
        }
        self._handle: RequestHandle | None = None
        self.created = False  # response.created sent: the client knows this response's id
        self._cancelled: str | None = None
        self._ended = asyncio.Event()  # set once run() has sent its last event
        self._usage = {"input_tokens": 0, "output_tokens": 0}

    @property
    def cancelling(self) -> bool:
        """Asked to stop (barge-in, `response.cancel`): its abort is under way in the stages."""
        return self._cancelled is not None

    async def ended(self) -> None:
        """Until run() has returned, its `.done` events (or its refusal) sent."""
        await self._ended.wait()

    async def run(self) -> None:
        try:
            try:
                async with admitted(self.state, self.model, wait=False):
                    outcome = await self._answer()
            finally:
                self._on_end(self)  # the place is free: the client may create the next one
        except ApiError as refusal:  # not ready, unavailable, or no free place: nothing ran
            await self.events.send(self._refused(refusal))
            self._ended.set()
            return
        try:
            await self._finish(*outcome)
        finally:
            self._ended.set()

    async def cancel(self, reason: str, *, notify: bool = True) -> None:
        """Stop the answer in every stage (abort, not mute); run() then reports it cancelled.
        `notify=False` (the socket is gone): the session forgets the response at once."""
        if self._cancelled is not None:
            return
        self._cancelled = reason
        if self._handle is not None:
            await self._handle.abort()
        if not notify:
            self._on_end(self)

    def _refused(self, refusal: ApiError) -> dict[str, Any]:
        """The protocol's `error` event for a response that never started, in HTTP's words."""
        error = {
            "type": refusal.type,
            "code": refusal.code,
            "message": refusal.message,
            "param": refusal.param,
            "event_id": self._event_id,
        }
        return {"type": "error", "error": error}

    def _view(self, status: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
        out_format = self.config.output_format
        view: dict[str, Any] = {
            "object": "realtime.response",
            "id": self.id,
            "status": status,
            "status_details": details,
            "output": [self.events.item_view(self.item)] if status != "in_progress" else [],
            "conversation_id": f"conv_{self.session_id}",
            "output_modalities": list(self.config.output_modalities),
            "max_output_tokens": self.config.max_output_tokens or "inf",
            "audio": {"output": {"format": out_format.ga(), "voice": self.config.voice}},
        }
        if status != "in_progress":
            total = self._usage["input_tokens"] + self._usage["output_tokens"]
            view["usage"] = {**self._usage, "total_tokens": total}
        return view

    async def _answer(self) -> Outcome:
        """From `response.created` to the end of the pipeline request."""
        events = self.events
        try:
            await events.send({"type": "response.created", "response": self._view("in_progress")})
            self.created = True
            if self._waits:  # the turn's transcript is the thinker's input
                await asyncio.gather(*self._waits, return_exceptions=True)
            previous = self.conversation.add(self.item)
            await events.send(
                {
                    "type": "response.output_item.added",
                    "response_id": self.id,
                    "output_index": 0,
                    "item": events.item_view(self.item),
                }
            )
            await events.item_added(self.item, previous)
            part = self.item.content[0]
            await events.send(
                {"type": "response.content_part.added", **self._where, "part": dict(part)}
            )
            await self._stream(part)
        except PipelineError as err:
            if self._cancelled is None:
                # a stage that refused the input (the conversation over the thinker's context:
                # `context_length_exceeded`) is the client's to fix, as HTTP's 400 is
                refused = err.code == "invalid_request"
                error: dict[str, Any] = {
                    "type": "invalid_request_error" if refused else "server_error",
                    "code": (err.error_code or "invalid_value") if refused else err.code,
                    "message": err.message,
                }
                param = err.param if refused else None
                await events.send({"type": "error", "error": {**error, "param": param}})
                return "failed", {"type": "failed", "error": error}
            # else our own abort ended the pipeline request
        if self._cancelled is not None:
            return "cancelled", {"type": "cancelled", "reason": self._cancelled}
        return "completed", None

    async def _stream(self, part: dict[str, Any]) -> None:
        config, where = self.config, self._where
        messages = self.conversation.messages(config.instructions)
        speech = None
        if self.audio:
            # the voice resamples once, to the session's rate (24 kHz PCM16, 8 kHz G.711)
            # a custom voice is looked up now: one deleted since session.update fails this
            # response (a 400-class error event), not the session
            choice = self.state.voices.resolve(self.model, config.voice)
            if choice is None:  # session.update checked it: a custom voice deleted since
                raise PipelineError(
                    f"the session's voice '{config.voice[:80]}' was deleted; choose another "
                    "with session.update",
                    code="invalid_request",
                    error_code="voice_not_found",
                    param="session.audio.output.voice",
                )
            speech = SpeechOptions(
                choice.name,
                reference=choice.reference,
                response_format="pcm",
                stream=True,
                speed=config.speed,
                seed=config.seed,
                sample_rate=config.output_format.rate,
                timing=True,  # word timings: transcript deltas and truncation
            )
        if messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:  # as the thinker would refuse it: the client's to fix
            raise PipelineError(
                "the conversation has no text for the model to answer",
                code="invalid_request",
                param="messages",
            )
        sampling = Sampling.resolve(
            self.model.sampling,  # top_p, top_k, min_p: no session field sets them
            max_tokens=config.max_output_tokens,
            temperature=config.temperature,
            seed=config.seed,
        )
        chat = ChatInput(
            tuple(Message(m["role"], m["content"]) for m in messages), sampling, speech
        )
        inputs = chat.payload()
        encoder = audio.Encoder(config.output_format, in_rate=config.output_format.rate)
        if self._cancelled is not None:
            return
        async with submitted(self.state, self.model, inputs) as handle:
            self._handle = handle
            async for _, chunk in handle.stream():
                if chunk.get("text"):
                    key = "transcript" if self.audio else "text"
                    part[key] += chunk["text"]
                    kind = (
                        "response.output_audio_transcript.delta"
                        if self.audio
                        else "response.output_text.delta"
                    )
                    await self.events.send({"type": kind, **where, "delta": chunk["text"]})
                if self.audio and chunk.get("audio"):
                    await self._audio(encoder.encode(bytes(chunk["audio"])))
                timing = chunk_timing(chunk) if self.audio else None
                if timing is not None and timing.words:
                    await self._words(timing)
            if self.audio:
                await self._audio(encoder.flush())
            result = await handle.result()
        for payload in (
            result.values() if isinstance(result, dict) and "usage" not in result else [result]
        ):
            if isinstance(payload, dict) and isinstance(payload.get("usage"), dict):
                self._usage = {
                    "input_tokens": int(payload["usage"].get("prompt_tokens", 0)),
                    "output_tokens": int(payload["usage"].get("completion_tokens", 0)),
                }

    async def _audio(self, data: bytes) -> None:
        if not data:
            return
        self.item.audio_ms += 1000 * len(data) / self.config.output_format.bytes_per_second()
        await self.events.send(
            {
                "type": "response.output_audio.delta",
                **self._where,
                "delta": base64.b64encode(data).decode(),
            }
        )

    async def _words(self, timing: SpeechTiming) -> None:
        """The voice's word timings (our extension): an empty transcript delta whose `words`
        say when each word plays, in ms of this item's audio (`audio_end_ms`'s clock); kept
        on the item, so a truncate cuts the transcript at the word then playing."""
        self.item.words.extend(timing.words)
        await self.events.send(
            {
                "type": "response.output_audio_transcript.delta",
                **self._where,
                "delta": "",
                "words": words_ms(timing),
            }
        )

    async def _finish(self, status: str, details: dict[str, Any] | None) -> None:
        """The `.done` events, innermost first, ending with `response.done`."""
        events, where = self.events, self._where
        self.item.status = "completed" if status == "completed" else "incomplete"
        part = self.item.content[0]
        if self.audio:
            await events.send({"type": "response.output_audio.done", **where})
            await events.send(
                {
                    "type": "response.output_audio_transcript.done",
                    **where,
                    "transcript": part["transcript"],
                }
            )
        else:
            await events.send({"type": "response.output_text.done", **where, "text": part["text"]})
        await events.send({"type": "response.content_part.done", **where, "part": dict(part)})
        view = events.item_view(self.item)
        await events.send(
            {
                "type": "response.output_item.done",
                "response_id": self.id,
                "output_index": 0,
                "item": view,
            }
        )
        if not events.beta:
            await events.send({"type": "conversation.item.done", "item": view})
        await events.send({"type": "response.done", "response": self._view(status, details)})
        await events.send({"type": "rate_limits.updated", "rate_limits": [self._requests()]})

    def _requests(self) -> dict[str, Any]:
        """The `requests` rate limit: the model's admission places, free ones now (this run
        has given its place back); a place frees as a response ends, not on a clock."""
        admission = self.state.admission
        limit = admission.max_in_flight
        free = max(0, limit - admission.in_flight(self.model.id))
        return {"name": "requests", "limit": limit, "remaining": free, "reset_seconds": 0.0}
