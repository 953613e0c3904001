"""Per-request streaming: drive each request's generate() one chunk at a time.

At every step the scheduler advances the runnable request that comes first in playback order
(stream_order.py): streams about to run dry, then first chunks, then the stream whose listener has
the least audio left (for a backend that says how long its chunks play; otherwise the one that
has produced the FEWEST chunks); ties go to the oldest. A new request's first chunk therefore
never waits behind the later chunks of streams that are ahead of their listeners, which keeps
time to first audio flat as concurrency grows. A request reading stream input is runnable only
when a chunk or the end marker is waiting for it, so one request waiting for upstream does not
stall the others.

One exception to the order of later chunks: a request whose stream input is all read (only its
end is left) goes right after first chunks, before later chunks (unless one is urgent). Its
next step reads the end and, for a stage that returns there, ends it. Ranked by its (many)
chunks it would wait for every other request's later chunks, so under a closed loop all
requests of a replica ended together and their callers' next requests came back as one burst
of first chunks queueing behind each other (measured on the voice at concurrency 16: first
chunks waited up to ~0.7 s; docs/voice.md).

Steps run on the stage's compute thread one at a time; the loop thread handles admissions and
aborts between steps. An aborted request's generator is closed (its `finally` blocks run) on the
compute thread; an exception from one generator fails that request alone.

First-chunk lane (`[scheduler] first_chunk_lane = true`, opt-in). The order above only
orders the queue: a first chunk still waits for the step already running, and for a TTS voice
that step is a whole sentence (hundreds of ms on a busy core). With the lane, a second compute
thread runs first chunks only, and only while the main thread is busy: a request's first chunk
starts beside the running step instead of behind it, and the OS shares the cores between the
two. When the main thread is idle it takes the first chunk itself, so a lone request runs
exactly as without the lane. Invariants kept:
- steps of ONE request never run at once (a request is marked running from pick to outcome,
  and neither lane picks a running request), so a generator needs no lock of its own; steps of
  DIFFERENT requests may, which is why the backend must opt in;
- generators are closed on the main compute thread, never while a step of theirs runs;
- an exception, or RequestAborted, ends its request alone, whichever lane ran the step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from omni_server.backend import RequestAborted

from .base import Scheduler, StageCallbacks, WorkItem
from .calls import StageCalls
from .stream_order import Playback, StepClock, rank


@dataclass(eq=False)
class ActiveRequest:
    """A request admitted to a stream stage: its generator (made at its first step), the chunks
    it has produced so far, whether a step of it is in flight, and (for a backend whose chunks
    are media) how far ahead of its listener it is."""

    item: WorkItem
    generator: Iterator[Any] | None = None
    chunks: int = 0
    running: bool = False  # a step of it is in flight, on either lane
    playback: Playback | None = None


def first_chunk_lane(
    executor: concurrent.futures.ThreadPoolExecutor,
) -> concurrent.futures.ThreadPoolExecutor:
    """A second compute thread beside the stage's `executor`.

    The runtime's executor (runtime.deadlines.ComputeExecutor) makes a sibling: the same thread
    setup (its CUDA device), the same watchdog over overrunning calls, shut down with it.
    Any other executor gets a plain one-thread pool, which the scheduler shuts down itself."""
    sibling = getattr(executor, "sibling", None)
    if sibling is not None:
        lane: concurrent.futures.ThreadPoolExecutor = sibling("-first")
        return lane
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stream-first-chunk")


# The two picks are the scheduling policy, kept apart from the loops that run it so that the
# order can be read (and tested) on its own.


def pick(
    active: Iterable[ActiveRequest], now: float | None = None, margin_s: float = 0.0
) -> ActiveRequest | None:
    """The main compute thread's next step among `active` (in admission order): the runnable,
    not running request that comes first in playback order (playback.rank) at `now`; ties go
    to the oldest. None: nothing to run."""
    now = time.monotonic() if now is None else now
    best: ActiveRequest | None = None
    best_key: tuple[int, float] | None = None
    for candidate in active:
        if not candidate.item.runnable or candidate.running:
            continue
        key = rank(candidate.chunks, candidate.item.finishing, candidate.playback, now, margin_s)
        if best_key is None or key < best_key:
            best, best_key = candidate, key
    return best


def pick_first(active: Iterable[ActiveRequest]) -> ActiveRequest | None:
    """The first-chunk lane's next step among `active` (in admission order): the oldest
    runnable, not running request with no chunk yet. The scheduler asks only while its main
    thread is busy (an idle main thread takes a first chunk itself)."""
    for candidate in active:
        if candidate.chunks == 0 and candidate.item.runnable and not candidate.running:
            return candidate
    return None


class StreamScheduler(Scheduler):
    def __init__(
        self,
        calls: StageCalls,
        callbacks: StageCallbacks,
        executor: concurrent.futures.ThreadPoolExecutor,
        *,
        first_chunk_lane: concurrent.futures.ThreadPoolExecutor | None = None,
    ) -> None:
        super().__init__(calls, callbacks, executor)
        self._active: dict[int, ActiveRequest] = {}  # insertion order = admission order
        self._lane = first_chunk_lane
        self._main_busy = False  # the main compute thread runs a step
        self._media = calls.plays_media  # chunks say how long they play: deadline order
        self._steps = StepClock()  # later chunks' step times: the margin of urgent streams

    @property
    def active_keys(self) -> frozenset[int]:
        return frozenset(self._active)

    def admit(self, item: WorkItem) -> None:
        playback = Playback() if self._media else None
        self._active[item.key] = ActiveRequest(item, playback=playback)
        self._wakeup.set()

    def abort(self, key: int) -> None:
        active = self._active.pop(key, None)
        if active is not None and active.generator is not None and not active.running:
            self._executor.submit(self.calls.close, active.item.request, active.generator)
        # a running step finds its request gone when it returns and closes the generator then

    async def run(self) -> None:
        if self._lane is None:
            await self._serve(first_only=False)
            return
        try:
            async with asyncio.TaskGroup() as lanes:  # a lane that fails cancels the other
                lanes.create_task(self._serve(first_only=False))
                lanes.create_task(self._serve(first_only=True))
        finally:
            # Cancelled (the host stops): a lane step may still be running. Calls the host
            # makes next on the main thread (finalize) wait for it, so no backend call overlaps
            # finalize().
            drained = self._lane.submit(lambda: None)
            self._executor.submit(concurrent.futures.wait, [drained])
            if getattr(self._executor, "sibling", None) is None:
                self._lane.shutdown(wait=False)  # our own pool (see first_chunk_lane)

    async def _serve(self, *, first_only: bool) -> None:
        """One lane's loop: pick, step, repeat; sleep when nothing is runnable for this lane."""
        executor = self._lane if first_only else None
        while True:
            if first_only:
                active = self._pick_first()
            else:
                active = pick(self._active.values(), time.monotonic(), self._steps.margin_s)
            if active is None:
                # no await between the pick and clear(): a wakeup cannot fall in between
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            active.running = True
            if not first_only:
                self._main_busy = True
                self._wakeup.set()  # the first-chunk lane may now take a first chunk
            try:
                await self._step(active, executor)
            finally:
                active.running = False
                if not first_only:
                    self._main_busy = False
                self._wakeup.set()  # the request may be runnable again, for the other lane too

    def _pick_first(self) -> ActiveRequest | None:
        """pick_first() while the main thread is busy (an idle main thread takes a first chunk
        itself: one step at a time whenever that costs no wait)."""
        return pick_first(self._active.values()) if self._main_busy else None

    async def _step(
        self, active: ActiveRequest, executor: concurrent.futures.ThreadPoolExecutor | None
    ) -> None:
        item = active.item
        try:
            outcome, start, seconds = await self._compute(self._advance, active, executor=executor)
        except RequestAborted:
            outcome, start, seconds = None, 0.0, 0.0
        except Exception as exc:  # noqa: BLE001 - the generator raised: fail this request only
            outcome, start, seconds = exc, 0.0, 0.0
        if self._active.get(item.key) is not active:  # aborted during the step
            if active.generator is not None:
                self._executor.submit(self.calls.close, active.item.request, active.generator)
            return
        if outcome is None:  # RequestAborted raised by the backend itself
            self._active.pop(item.key)
            return
        if isinstance(outcome, BaseException):
            self._active.pop(item.key)
            self.callbacks.fail(item, outcome)
            return
        item.started(start)
        item.compute_s += seconds
        playback = active.playback
        if outcome[0] == "chunk":
            if playback is not None:
                if playback.started:  # first chunks are cut short: they would understate
                    self._steps.record(seconds)  # how long a stream's next step takes
                playback.produced(outcome[2], time.monotonic())
            active.chunks += 1
            self.callbacks.chunk(item, outcome[1])
        else:
            self._active.pop(item.key)
            if playback is not None:
                item.min_lead_s = playback.min_lead
            self.callbacks.complete(item, outcome[1], outcome[2])

    def _advance(self, active: ActiveRequest) -> Any:
        """One step: ("chunk", chunk, media seconds) or ("done", payload, targets)."""
        if active.generator is None:
            active.generator = self.calls.generate(active.item.request)
        outcome = self.calls.step(active.item.request, active.generator)
        if outcome[0] == "chunk":
            seconds = self.calls.playback_seconds(outcome[1]) if self._media else 0.0
            return ("chunk", outcome[1], seconds)
        return outcome
