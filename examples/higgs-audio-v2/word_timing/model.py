"""Word timing (terminal, `kind = "ar"` fed by the vocoder's chunks): the audio forced-aligned
to its text as it streams.

Reads the vocoder's chunks ({"audio": body bytes, "samples": float32, "sample_rate"}, the first
with "text", the last with "result"). A request whose caller shows no timing (its
SpeechOptions.timing false: "text" None) passes through untouched: no alignment, no wait. A
step sends every stream's new bytes on at once, with, under "timing" (`SpeechTiming`), the
words placed since its last chunk (omni_server.audio.forced_alignment: a segment's words once
the pause after it is there).
Times are the utterance's (seconds from its first sample, after speed and resampling), so a
chunk's timing may be of words whose audio went out in earlier chunks.

The alignment never runs on the stage's compute thread: each stream's audio is aligned in
order by a pool of `workers` threads (CTranslate2 computes without the GIL), so one stream's
alignment holds back no stream's audio. Only a stream's last bytes wait, for its last words'
alignment, so that they carry the timing (a transport sends timing with audio). Result: the
vocoder's.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omni_server.audio.forced_alignment import Segmenting, StreamAligner, WhisperAligner
from omni_server.backend import (
    Request,
    RequestAborted,
    StageBackend,
    StageConfigError,
    StageContext,
    StepOutput,
)
from omni_server.contracts import SpeechTiming

log = logging.getLogger("omni_server.examples.higgs.word_timing")

SEGMENTING = ("min_segment_s", "max_segment_s", "min_pause_s", "silence_db")
WAIT_S = 0.005  # a step with only alignments to wait for sleeps up to this long for one


@dataclass(eq=False)
class Timed:
    """One request's alignment. The compute thread queues audio (None: the end); one pool
    worker at a time drains the queue into `ready`. `lock` guards queue, ready, running,
    finished and error."""

    request: Request
    aligner: StreamAligner | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    queue: deque[np.ndarray | None] = field(default_factory=deque)
    ready: list[SpeechTiming] = field(default_factory=list)
    running: bool = False  # a worker is draining the queue
    finished: bool = False  # the worker has aligned the end
    error: BaseException | None = None
    ended: bool = False  # the vocoder's last chunk came (compute thread only)
    plain: bool = False  # no timing asked for: the audio passes through (compute thread only)
    held: bytearray = field(default_factory=bytearray)  # the last bytes, until finished
    result: dict[str, Any] = field(default_factory=dict)


class WordTiming(StageBackend):
    def initialize(self, context: StageContext) -> None:
        params = context.parameters
        counts = {}
        for key in ("cpu_threads", "workers"):
            value = params.get(key, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise StageConfigError(f"parameters.{key} must be an integer >= 1; got {value!r}")
            counts[key] = value
        values = {k: params[k] for k in SEGMENTING if k in params}
        for key, value in values.items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise StageConfigError(f"parameters.{key} must be a number; got {value!r}")
        try:
            self.segmenting = Segmenting(**{k: float(v) for k, v in values.items()})
        except ValueError as err:
            raise StageConfigError(f"parameters: {err}") from err
        self.aligner = WhisperAligner(cpu_threads=counts["cpu_threads"], workers=counts["workers"])
        self.pool = ThreadPoolExecutor(counts["workers"], thread_name_prefix="word_timing")
        self.done = threading.Event()  # a worker finished a stream's end
        self._held: dict[int, Timed] = {}  # id(request) -> its alignment, from add() to its end

    def finalize(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ---- the ar contract (compute thread) -----------------------------------------------------

    def add(self, request: Request) -> None:
        self._held[id(request)] = Timed(request)

    def abort(self, request: Request) -> None:
        timed = self._held.pop(id(request), None)
        if timed is not None:
            with timed.lock:
                timed.queue.clear()  # its worker stops after the call in progress

    def has_work(self) -> bool:
        """A stream whose end came waits for its last alignment: step again."""
        return any(t.ended for t in self._held.values())

    def step(self) -> list[StepOutput]:
        outputs = []
        for key, timed in list(self._held.items()):
            try:
                output = self._step(timed)
            except RequestAborted:
                continue  # its abort() comes before the next step
            except Exception as exc:  # noqa: BLE001 - a bad stream or alignment: that request
                output = StepOutput(timed.request, error=exc)
            if output is not None:
                outputs.append(output)
                if output.finished or output.error is not None:
                    self._held.pop(key, None)
        if not outputs and self.has_work():  # only alignments to wait for: not a busy loop
            self.done.wait(WAIT_S)
            self.done.clear()
        return outputs

    def _step(self, timed: Timed) -> StepOutput | None:
        chunks, ended = timed.request.take_stream()
        audio = bytearray()
        for chunk in chunks:
            if timed.aligner is None and not timed.plain:
                text, rate = chunk["text"], int(chunk["sample_rate"])
                if text is None:
                    timed.plain = True
                else:
                    timed.aligner = StreamAligner(self.aligner, text, rate, self.segmenting)
            audio += chunk["audio"]
            if timed.plain:
                if "result" in chunk:
                    timed.result, ended = chunk["result"], True
                continue
            self._queue(timed, chunk["samples"])
            if "result" in chunk:
                timed.result = chunk["result"]
                ended = True
        if timed.plain:
            if ended:
                return StepOutput(timed.request, chunk={"audio": bytes(audio)}, finished=True,
                                  result=timed.result)  # fmt: skip
            return StepOutput(timed.request, chunk={"audio": bytes(audio)}) if audio else None
        if ended and not timed.ended:
            if timed.aligner is None:
                raise RuntimeError("the vocoder sent no audio")
            timed.ended = True
            self._queue(timed, None)
        with timed.lock:
            if timed.error is not None:
                raise timed.error
            placed, timed.ready = timed.ready, []
            finished = timed.finished
        if timed.ended:  # the last bytes wait for the last words
            timed.held += audio
            audio = timed.held if finished else bytearray()
        out: dict[str, Any] = {"audio": bytes(audio)}
        if placed:
            out[SpeechTiming.KEY] = SpeechTiming.joined(placed)
        if finished:
            assert timed.aligner is not None
            log.debug("word_timing %s: %d segments aligned in %.3f s", timed.request.id,
                      timed.aligner.segments, timed.aligner.align_seconds)  # fmt: skip
            return StepOutput(timed.request, chunk=out, finished=True, result=timed.result)
        if audio or placed:
            return StepOutput(timed.request, chunk=out)
        return None

    # ---- the pool -----------------------------------------------------------------------------

    def _queue(self, timed: Timed, samples: np.ndarray | None) -> None:
        with timed.lock:
            timed.queue.append(samples)
            if timed.running:
                return
            timed.running = True
        self.pool.submit(self._drain, timed)

    def _drain(self, timed: Timed) -> None:
        """A worker: the stream's queued audio through its aligner, in order, until empty."""
        assert timed.aligner is not None
        while True:
            with timed.lock:
                if not timed.queue or timed.error is not None:
                    timed.running = False
                    return
                samples = timed.queue.popleft()
            try:
                timing = timed.aligner.push(samples) if samples is not None else (
                    timed.aligner.finish())  # fmt: skip
            except BaseException as exc:  # noqa: BLE001 - handed to the compute thread
                with timed.lock:
                    timed.error, timed.running = exc, False
                self.done.set()
                return
            with timed.lock:
                if timing is not None:
                    timed.ready.append(timing)
                if samples is None:
                    timed.finished = True
            if samples is None:
                self.done.set()
