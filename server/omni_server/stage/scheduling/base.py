"""The scheduler interface: how one stage's admitted requests become backend calls.

A stage host owns one scheduler per stage. The host admits requests (inputs complete), aborts
them, and wakes the scheduler when stream input arrives; the scheduler decides what runs next,
runs backend calls through `StageCalls` on the stage's single compute thread, and reports every
outcome through `StageCallbacks` on the event loop. Nothing here knows about transports or
processes, so a continuous-batching step loop for autoregressive stages is one more subclass:
admit() feeds its waiting queue, run() alternates schedule -> step -> postprocess, and chunk() /
complete() report tokens as they come.

Invariants:
- admit / abort / wake and every callback run on the event-loop thread;
- every backend call of one stage runs on that stage's one compute thread, one at a time
  (backends need no locks, and TP ranks see the same call order). The one exception is opt-in:
  a stream stage with `first_chunk_lane = true` also runs first chunks on a second thread
  (stream.py), so its backend's generate() steps of different requests must be thread-safe;
- every admitted request ends in exactly one complete() or fail(), unless it is aborted first,
  after which no callback mentions it.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from omni_server.backend import Request
from omni_server.envelope import Envelope, Payload, Timings

from .calls import StageCalls

T = TypeVar("T")


class StreamInput(Protocol):
    @property
    def ready(self) -> bool:
        """A chunk (or the end marker) is waiting: a step reading the stream will not block."""
        ...

    @property
    def drained(self) -> bool:
        """The stream has ended and every chunk was read: the next step reads its end."""
        ...

    # An ar scheduler sets it between steps: while set, the backend's take_stream() reads
    # nothing (a terminal request out of credit keeps its chunks queued)
    paused: bool


@dataclass(eq=False)
class WorkItem:
    """One admitted request at one stage."""

    env: Envelope
    request: Request
    timings: Timings  # of the stages upstream
    stream: StreamInput | None = None  # chunks along stream_to edges into this stage
    admitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    compute_s: float = 0.0
    # a media stream's smallest lead over its listener (omni_server/playback.py); NaN: not a
    # media stream
    min_lead_s: float = math.nan

    @property
    def key(self) -> int:
        return self.env.key

    @property
    def has_credit(self) -> bool:
        """Its caller has room for another chunk (only a paced terminal request runs out)."""
        return True

    @property
    def runnable(self) -> bool:
        return self.has_credit and (self.stream is None or self.stream.ready)

    @property
    def finishing(self) -> bool:
        """Its whole stream input is read: its next step is (for a stage that returns at the
        end of its input) its last, and short."""
        return self.stream is not None and self.stream.drained

    def started(self, now: float) -> None:
        if self.started_at is None:
            self.started_at = now

    @property
    def queue_s(self) -> float:
        return (self.started_at or self.admitted_at) - self.admitted_at


class StageCallbacks(Protocol):
    """Outcomes, reported on the event-loop thread."""

    def chunk(self, item: WorkItem, chunk: Payload) -> None: ...

    def chunks(self, batch: list[tuple[WorkItem, Payload]]) -> None:
        """Chunks of several requests from one step, in order (as chunk() for each, but each
        destination process gets them as one message)."""

    def complete(self, item: WorkItem, payload: Payload | None, targets: tuple[str, ...]) -> None:
        """The request is done here; `targets` are the `next` stages its payload goes to."""

    def fail(self, item: WorkItem, error: BaseException) -> None: ...


class Scheduler(abc.ABC):
    def __init__(
        self,
        calls: StageCalls,
        callbacks: StageCallbacks,
        executor: concurrent.futures.ThreadPoolExecutor,
    ) -> None:
        self.calls = calls
        self.callbacks = callbacks
        self._executor = executor
        self._wakeup = asyncio.Event()

    @property
    @abc.abstractmethod
    def active_keys(self) -> frozenset[int]:
        """The requests admitted here that have not ended or been aborted yet (what
        `StageNode.holds` asks of its scheduler)."""

    @abc.abstractmethod
    def admit(self, item: WorkItem) -> None:
        """Queue a request whose inputs are complete."""

    @abc.abstractmethod
    def abort(self, key: int) -> None:
        """Forget a request: it is not run again and no callback mentions it any more.

        The host has already set the request's abort flag, so a running call sees it.
        """

    @abc.abstractmethod
    async def run(self) -> None:
        """The scheduling loop; runs until cancelled."""

    def finish(self, key: int) -> bool:
        """End request `key` early with what it has (its stage's timeout_s ran out), as its
        own end would; False when this scheduler or its backend cannot (the request then
        fails as timed out)."""
        return False

    def wake(self) -> None:
        """Stream input arrived for an admitted request."""
        self._wakeup.set()

    async def _compute(
        self,
        fn: Callable[..., T],
        *args: Any,
        executor: concurrent.futures.Executor | None = None,
    ) -> tuple[T, float, float]:
        """Run one backend call on the stage's compute thread (or `executor`, a stream stage's
        first-chunk lane): (result, start, seconds)."""
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        result = await loop.run_in_executor(executor or self._executor, fn, *args)
        return result, start, time.monotonic() - start
