"""Admission per served model: a bounded number of requests in the pipeline, a bounded queue.

A request takes a place before it is submitted and gives it back when its response is done (or
it failed, or its client left). With every place taken it waits in a first-come queue; with the
queue full, or after `queue_timeout_s` in it, it is refused at once with 429, `Retry-After` and
OpenAI's `rate_limit_exceeded` error, so admitted requests keep their latency under overload
instead of every request slowing down together.

Invariant (one model): `in_flight` counts places held, including places handed to a waiter whose
task has not resumed yet; a waiter's future is done exactly when it holds a place.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from omni_server.serve.errors import ApiError

RETRY_AFTER_S = 1  # a place frees when one request finishes: usually well within a second
RATE_LIMITED = "rate_limit_exceeded"  # OpenAI's code for a 429


class RateLimited(ApiError):
    def __init__(self, message: str) -> None:
        super().__init__(
            429,
            message,
            code=RATE_LIMITED,
            type="requests",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


@dataclass
class _Gate:
    in_flight: int = 0
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)


class Admission:
    def __init__(
        self,
        max_in_flight: int,
        max_queued: int,
        queue_timeout_s: float,
        on_queue: Callable[[str, int], None] | None = None,
    ) -> None:
        """`on_queue(model, length)` hears every change of a model's queue (a metrics gauge)."""
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self._on_queue = on_queue
        self._gates: dict[str, _Gate] = {}

    def _queue_changed(self, model: str, gate: _Gate) -> None:
        if self._on_queue is not None:
            self._on_queue(model, len(gate.waiters))

    def in_flight(self, model: str) -> int:
        return self._gates[model].in_flight if model in self._gates else 0

    def queued(self, model: str) -> int:
        return len(self._gates[model].waiters) if model in self._gates else 0

    @contextlib.asynccontextmanager
    async def place(self, model: str, *, wait: bool = True) -> AsyncIterator[None]:
        """Hold one of `model`'s places for the block; raises RateLimited (429) when none comes.

        `wait=False`: a place now or RateLimited now, never the queue (a realtime response:
        a caller mid-conversation is told at once instead of hearing nothing for the queue's
        timeout). It never takes a place ahead of a waiter."""
        gate = self._gates.setdefault(model, _Gate())
        if wait:
            await self._acquire(gate, model)
        else:
            self._take_free(gate, model)
        try:
            yield
        finally:
            self._release(gate, model)

    def _take_free(self, gate: _Gate, model: str) -> None:
        if gate.in_flight >= self.max_in_flight or gate.waiters:
            raise RateLimited(
                f"model '{model}' has no free place ({self.max_in_flight} requests in progress, "
                f"{len(gate.waiters)} waiting); retry after {RETRY_AFTER_S} s"
            )
        gate.in_flight += 1

    async def _acquire(self, gate: _Gate, model: str) -> None:
        if gate.in_flight < self.max_in_flight and not gate.waiters:
            gate.in_flight += 1
            return
        if len(gate.waiters) >= self.max_queued:
            raise RateLimited(
                f"model '{model}' is at capacity ({self.max_in_flight} requests in progress, "
                f"{self.max_queued} waiting); retry after {RETRY_AFTER_S} s"
            )
        waiter = asyncio.get_running_loop().create_future()
        gate.waiters.append(waiter)
        self._queue_changed(model, gate)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.queue_timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if waiter.done() and not waiter.cancelled():
                self._release(gate, model)  # granted in the same instant: hand the place on
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    gate.waiters.remove(waiter)
                self._queue_changed(model, gate)
            if isinstance(exc, TimeoutError):
                raise RateLimited(
                    f"model '{model}' had no free place within {self.queue_timeout_s:g} s "
                    f"({self.max_in_flight} requests in progress); retry after "
                    f"{RETRY_AFTER_S} s"
                ) from None
            raise

    def _release(self, gate: _Gate, model: str) -> None:
        while gate.waiters:
            waiter = gate.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the place passes to the waiter; in_flight unchanged
                self._queue_changed(model, gate)
                return
        gate.in_flight -= 1
        self._queue_changed(model, gate)
