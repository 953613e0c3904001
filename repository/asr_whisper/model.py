"""Recognizer stage: Whisper tiny.en over the segmenter's windows, the windows of every request
under way batched together, each request's segments streamed a batch at a time.

Each request's first chunk is the transcript's header ({"language", "duration"}); then one
{"segments": [...]} chunk per call that finished some of its windows, in window order. The
recognizer is `omni_server.audio.whisper.Recognizer`, the same code the tools' WER judge hears
with; `omni_server.audio.window_batch` keeps each request's progress and picks each call's
windows (round-robin over the requests, a request's first call one window, then doubling).

Continuous batching (`kind = "ar"`): requests join between calls, so a window that is ready
when a call starts shares it with the other requests' windows (at most `max_batch`). When
requests have lately been arriving together, a call that is not full waits up to `gather_ms`
after the last arrival (never longer than 4x that) for the next, so the windows of a closed
loop's clients, which arrive a few tens of ms apart, share calls rather than drift apart; a
lone request never waits. A call that fails fails the requests whose windows it held: with more
than one of them, each request's windows are decoded again alone, so an error stays its own.
"""

from __future__ import annotations

import time

from omni_server.audio import whisper
from omni_server.audio.window_batch import Transcription, Window, plan_batch
from omni_server.backend import (
    Request,
    StageBackend,
    StageConfigError,
    StageContext,
    StepOutput,
)
from omni_server.contracts import AsrOptions

TOGETHER_S = 5.0  # a call of several requests this recently: expect more arrivals together
GATHER_POLL_S = 0.002  # how long step() sleeps while gathering (new requests join between)
GATHER_MOST = 4  # a call waits at most this many gather windows in all


class WhisperStage(StageBackend):
    def initialize(self, context: StageContext) -> None:
        p = context.parameters
        descriptor = context.stage_dir / "stage.toml"
        threads, batch = p.get("cpu_threads", 2), p.get("batch_size", 4)
        beam = p.get("beam_size", whisper.SERVED_BEAM_SIZE)
        most = p.get("max_batch", 8)
        for name, value, bound in (
            ("cpu_threads", threads, None),
            ("batch_size", batch, None),
            ("beam_size", beam, whisper.MAX_BEAM_SIZE),
            ("max_batch", most, None),
        ):
            bad = isinstance(value, bool) or not isinstance(value, int) or value < 1
            if bad or (bound is not None and value > bound):
                within = f"in [1, {bound}]" if bound is not None else ">= 1"
                raise StageConfigError(
                    f"{descriptor}: parameters.{name} must be an integer {within}, found {value!r}"
                )
        gather = p.get("gather_ms", 30)
        if isinstance(gather, bool) or not isinstance(gather, int | float) or not gather >= 0:
            raise StageConfigError(
                f"{descriptor}: parameters.gather_ms must be a number >= 0, found {gather!r}"
            )
        compute_type = p.get("compute_type", "int8")
        if compute_type not in ("int8", "float32", "int8_float32"):
            raise StageConfigError(
                f'{descriptor}: parameters.compute_type must be "int8", "int8_float32" or '
                f'"float32" on CPU, found {compute_type!r}'
            )
        model = whisper.load_whisper(cpu_threads=threads, compute_type=compute_type)
        self.recognizer = whisper.Recognizer(model, batch_size=batch, beam_size=beam)
        self.max_batch = most
        self.gather_s = float(gather) / 1000
        # id(request) -> (request, its transcription); insertion order is arrival order
        self._held: dict[int, tuple[Request, Transcription]] = {}
        self._new: list[Request] = []  # added since the last step: their header is owed
        self._last_add = 0.0
        self._together_until = 0.0
        self._waiting_since: float | None = None

    def add(self, request: Request) -> None:
        inputs = request.inputs
        asked = AsrOptions.of(inputs)  # the endpoint's typed options, passed on by the decoder
        options = whisper.DecodeOptions(
            prompt=asked.prompt,
            temperature=asked.temperature,
            words=asked.words,
            logprobs=asked.logprobs,
        )
        clip = self.recognizer.transcription(inputs["audio"], inputs["windows"], options)
        self._held[id(request)] = (request, clip)
        self._new.append(request)
        self._last_add = time.monotonic()

    def abort(self, request: Request) -> None:
        self._held.pop(id(request), None)
        if request in self._new:
            self._new.remove(request)

    def step(self) -> list[StepOutput]:
        outputs = [self._header(request) for request in self._new]
        self._new = []
        clips = [clip for _, clip in self._held.values()]
        if any(clip.pending for clip in clips):
            now = time.monotonic()
            if self._waiting_since is None:
                self._waiting_since = now
            if self._gathering(clips, now):
                time.sleep(GATHER_POLL_S)
                return outputs
            self._waiting_since = None
            batch = plan_batch(clips, self.max_batch)
            failed = self._decode(batch)
            if len({id(w.owner) for w in batch}) > 1:
                self._together_until = time.monotonic() + TOGETHER_S
        else:
            failed = {}
        for key, (request, clip) in list(self._held.items()):
            if key in failed:
                del self._held[key]
                outputs.append(StepOutput(request, error=failed[key]))
                continue
            segments = clip.ready()
            done = clip.finished
            if segments or done:
                chunk = {"segments": segments} if segments else None
                outputs.append(StepOutput(request, chunk=chunk, finished=done))
            if done:
                del self._held[key]
        return outputs

    def _header(self, request: Request) -> StepOutput:
        duration = float(request.inputs["duration"])
        return StepOutput(request, chunk={"language": whisper.LANGUAGE, "duration": duration})

    def _gathering(self, clips: list[Transcription], now: float) -> bool:
        """Wait for more requests before this call? Only while requests have lately come
        together, the call is not full, and one arrived within gather_ms."""
        if self.gather_s <= 0 or now >= self._together_until or self._waiting_since is None:
            return False
        ready = sum(clip.allowance for clip in clips)
        return (
            ready < self.max_batch
            and now - self._last_add < self.gather_s
            and now - self._waiting_since < self.gather_s * GATHER_MOST
        )

    def _decode(self, batch: list[Window]) -> dict[int, BaseException]:
        """One call over `batch`; the requests it failed (by id(request)) with their error."""
        owners = list(dict.fromkeys(w.owner for w in batch))
        try:
            self.recognizer.decode(batch)
            return {}
        except Exception as error:  # noqa: BLE001 - fails the requests it held (below), not all
            if len(owners) == 1:
                return {self._key(owners[0]): error}
        failed: dict[int, BaseException] = {}
        for owner in owners:  # which request's windows failed it: each alone
            try:
                self.recognizer.decode([w for w in batch if w.owner is owner])
            except Exception as alone:  # noqa: BLE001 - the request's own error fails it alone
                failed[self._key(owner)] = alone
        return failed

    def _key(self, clip: Transcription) -> int:
        return next(key for key, (_, held) in self._held.items() if held is clip)
