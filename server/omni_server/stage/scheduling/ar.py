"""Continuous batching for autoregressive stages (`kind = "ar"`): one step loop for all requests.

The backend holds the running batch (its engine: KV cache, sampler). The loop alternates, on the
stage's compute thread: hand the backend the requests admitted since the last step (`add`) and
drop the aborted ones (`abort`), then run one `step()` over everything it holds; back on the
event loop, each request's chunk streams out at once and a finished request completes. Requests
join and leave between steps, so a new request never waits for a running one to finish.

Invariants (beside the scheduler's):
- add / abort / finish / step run only on the compute thread (abort, add, finish, step within
  one cycle), so the backend needs no locks;
- a request is in `_held` from its add() until it finished, failed, or its abort() ran: an
  aborted request's late outputs are dropped, and its abort() reaches the backend exactly once
  (freeing its KV cache at once);
- an add() that raises fails that request alone (InvalidRequest: the caller's fault, a 400);
- a step() out of GPU memory fails every request the backend holds and aborts them there (their
  KV freed); the loop goes on with the next requests (oom.py).

Fed by chunks (a `stream_to` target: the Higgs vocoder): each step takes what is waiting for
its requests (`Request.take_stream()`), so one step reads every stream's new chunks and can
batch their work. Such a request has work only when its chunks or its end wait, and a terminal
one only while its caller has credit for another chunk (a slow reader pauses it: its reads
return nothing until credit comes back); the loop sleeps while no held request has work, and
wakes when chunks, ends or credits arrive. A request not fed by chunks always has work (an
engine's next token). A backend that bounds its steps (the vocoder decodes for a few ms a step,
so that first chunks and new frames are not held behind a long one) says with `has_work()`,
asked right after each step, that work is left which needs no new chunk: the loop steps again.

Playback: a backend whose chunks are media says how long each plays (`playback_seconds(chunk)`,
as a stream stage's: the Higgs TTS engine's frames). The scheduler then keeps each request's
lead over a listener playing from its first chunk (omni_server.playback) and reports its
smallest one with its timings: `omni_stage_stream_lead_seconds` and
`omni_stage_stream_underruns_total` count it as they count a stream stage's. Who steps is the
backend's batch to decide (the engine orders by the same leads: engine/deadline_order.py).
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from omni_server.backend import Request
from omni_server.playback import Playback

from .base import Scheduler, StageCallbacks, WorkItem
from .calls import BackendContractError, StageCalls
from .oom import OutOfGPUMemory


class ARScheduler(Scheduler):
    def __init__(
        self,
        calls: StageCalls,
        callbacks: StageCallbacks,
        executor: concurrent.futures.ThreadPoolExecutor,
    ) -> None:
        super().__init__(calls, callbacks, executor)
        self._items: dict[int, WorkItem] = {}  # key -> item, for requests not yet ended here
        self._joining: list[WorkItem] = []  # admitted, add() not yet called
        self._leaving: list[Request] = []  # aborted after add(): abort() not yet called
        self._held: dict[int, Request] = {}  # id(request) -> request the backend holds
        self._finishing: list[Request] = []  # to end early: finish() not yet called
        self._media = calls.plays_media  # chunks say how long they play: leads are kept
        self._playback: dict[int, Playback] = {}  # key -> its listener's lead, from 1st chunk
        self._backlog = False  # the last step left work that needs no new chunk (has_work)

    @property
    def active_keys(self) -> frozenset[int]:
        return frozenset(self._items)

    def admit(self, item: WorkItem) -> None:
        self._items[item.key] = item
        self._joining.append(item)
        self._wakeup.set()

    def abort(self, key: int) -> None:
        item = self._items.pop(key, None)
        self._playback.pop(key, None)
        if item is None:
            return
        if item in self._joining:
            self._joining.remove(item)  # never reached the backend
        else:
            self._leaving.append(item.request)
            self._wakeup.set()

    def finish(self, key: int) -> bool:
        item = self._items.get(key)
        if item is None or not self.calls.can_finish:
            return False
        self._finishing.append(item.request)
        self._wakeup.set()
        return True

    async def run(self) -> None:
        while True:
            if not self._has_work():
                # no await between the check and clear(): a wakeup cannot fall in between
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self._gate_reads()
            joining, self._joining = self._joining, []
            leaving, self._leaving = self._leaving, []
            finishing, self._finishing = self._finishing, []
            (refused, outputs), start, seconds = await self._compute(
                self._cycle, joining, leaving, finishing
            )
            for item, error in refused:
                if self._items.pop(item.key, None) is not None:
                    self.callbacks.fail(item, error)
            for item in joining:  # in the backend's batch from this step on, output or not
                item.started(start)
            self._report(outputs, start, seconds)

    def _held_items(self) -> list[WorkItem]:
        return [item for item in self._items.values() if id(item.request) in self._held]

    def _has_work(self) -> bool:
        """Whether a cycle is due: requests join, leave or end early, or a held request has
        work (one fed by chunks: its chunks or end wait, and it has credit)."""
        if self._joining or self._leaving or self._finishing or (self._backlog and self._held):
            return True
        return any(item.stream is None or item.runnable for item in self._held_items())

    def _gate_reads(self) -> None:
        """Event loop, before a cycle: a request out of credit reads nothing in it."""
        for item in self._held_items():
            if item.stream is not None:
                item.stream.paused = not item.has_credit

    def _cycle(
        self, joining: list[WorkItem], leaving: list[Request], finishing: list[Request]
    ) -> tuple[list[tuple[WorkItem, BaseException]], list[tuple[Request, Any]]]:
        """Compute thread: leave, join, end early, step."""
        for request in leaving:
            if self._held.pop(id(request), None) is not None:
                self.calls.abort(request)
        refused: list[tuple[WorkItem, BaseException]] = []
        for item in joining:
            try:
                self.calls.add(item.request)
            except Exception as exc:  # noqa: BLE001 - a refused request fails alone
                refused.append((item, exc))
                continue
            self._held[id(item.request)] = item.request
        ended: list[tuple[Request, Any]] = []
        for request in finishing:  # its final output comes out of this cycle's step
            if id(request) not in self._held:
                continue
            try:
                self.calls.finish(request)
            except Exception as exc:  # noqa: BLE001 - a failed finish fails its request alone
                del self._held[id(request)]
                self.calls.abort(request)
                ended.append((request, exc))
        try:
            outputs: list[tuple[Request, Any]] = (
                self.calls.ar_step(dict(self._held)) if self._held else []
            )
        except OutOfGPUMemory as error:
            # Which of its requests the step ran, the backend alone knows: fail them all, and
            # abort each so the backend frees its KV now; new requests start from a clean cache.
            outputs = []
            for request in self._held.values():
                self.calls.abort(request)
                outputs.append((request, error))
            self._held.clear()
        if self._media:
            outputs = [self._timed(request, outcome) for request, outcome in outputs]
        for request, outcome in outputs:
            if not (isinstance(outcome, tuple) and outcome[0] == "chunk"):
                self._held.pop(id(request), None)  # finished or failed: the backend let go
        self._backlog = bool(self._held) and self.calls.has_work()
        return refused, ended + outputs

    def _timed(self, request: Request, outcome: Any) -> tuple[Request, Any]:
        """Compute thread: a chunk with the seconds it plays ("chunk", chunk, seconds); a
        backend that answers nonsense fails that request (and lets go of it)."""
        if not (isinstance(outcome, tuple) and outcome[0] == "chunk"):
            return request, outcome
        try:
            return request, (*outcome, self.calls.playback_seconds(outcome[1]))
        except BackendContractError as error:
            if self._held.pop(id(request), None) is not None:
                self.calls.abort(request)
            return request, error

    def _report(self, outputs: list[tuple[Request, Any]], start: float, seconds: float) -> None:
        """Event loop: stream chunks, complete or fail requests (aborted ones are dropped).

        The step's chunks go out together (`chunks`: one message per destination process);
        those gathered so far are sent before any request completes or fails, so a stream's
        end never overtakes its chunks."""
        by_request = {id(item.request): item for item in self._items.values()}
        stepped: set[int] = set()
        pending: list[tuple[WorkItem, Any]] = []
        for request, outcome in outputs:
            item = by_request.get(id(request))
            if item is None or item.key not in self._items:
                continue  # aborted meanwhile
            if item.key not in stepped:  # one step's time counts once per request
                stepped.add(item.key)
                item.started(start)
                item.compute_s += seconds
            if not isinstance(outcome, BaseException) and outcome[0] == "chunk":
                if self._media:
                    playback = self._playback.setdefault(item.key, Playback())
                    playback.produced(outcome[2], time.monotonic())
                pending.append((item, outcome[1]))
                continue
            if pending:
                self.callbacks.chunks(pending)
                pending = []
            del self._items[item.key]
            if isinstance(outcome, BaseException):
                self._playback.pop(item.key, None)
                self.callbacks.fail(item, outcome)
            else:
                ended = self._playback.pop(item.key, None)
                if ended is not None:
                    item.min_lead_s = ended.min_lead
                self.callbacks.complete(item, outcome[0], outcome[1])
        if pending:
            self.callbacks.chunks(pending)
