"""The coordinator: request life cycle in the main process.

It admits a request (binding one replica per replicated process: `binding.ReplicaBinder`),
hands its inputs to the model's entry stage, collects chunks and results from terminal stages,
merges several terminals' results, and fails or aborts a request everywhere it may have gone.
Stages pass payloads to each other directly; the coordinator only sees the ends.

A request completes when every terminal among its model's stages has reported: its result, or
`TerminalSkipped` when route methods upstream left it out. The result holds only the terminals
that produced one; a request whose terminals were all skipped fails.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from omni_server.compiler.plan import ModelSpec, Plan
from omni_server.envelope import Envelope, Payload, Timings
from omni_server.errors import PipelineError
from omni_server.wire.links import Links
from omni_server.wire.messages import (
    CHUNK_WINDOW,
    UNLIMITED,
    Abort,
    CoordinatorMessage,
    Credit,
    Deliver,
    StageFailed,
    StageTimedOut,
    TerminalChunk,
    TerminalResult,
    TerminalSkipped,
)
from omni_server.wire.routes import Routes

from .binding import ReplicaBinder

log = logging.getLogger(__name__)

StageObserver = Callable[[str, float, float, float], None]  # stage, queue, compute, min lead


_END = object()


class RequestHandle:
    """One submitted request. Leaving `async with` before it finished aborts it everywhere."""

    def __init__(self, coordinator: Coordinator, key: int, request_id: str) -> None:
        self.id = request_id
        self._coordinator = coordinator
        self._key = key
        # Bounded by credits: each terminal stage has at most CHUNK_WINDOW chunks here that the
        # consumer has not taken (stage.py pauses the request when it has no credit left).
        self._chunks: asyncio.Queue[Any] = asyncio.Queue()
        self._taken: dict[str, int] = {}  # chunks taken per terminal stage, not yet credited
        self._paced = True  # False once result() is awaited without reading the stream
        self._result: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # a failure nobody awaited is still a handled outcome: no "never retrieved" warnings
        self._result.add_done_callback(lambda f: f.cancelled() or f.exception())

    @property
    def done(self) -> bool:
        return self._result.done()

    @property
    def key(self) -> int:
        """The request's wire key: how the stages name it (`StageNode.holds(key)`)."""
        return self._key

    @property
    def buffered_chunks(self) -> int:
        """Chunks (and the end) that reached this handle and the consumer has not taken yet:
        what the server holds for a slow reader, at most CHUNK_WINDOW per paced stage."""
        return self._chunks.qsize()

    def __aiter__(self) -> AsyncIterator[Payload]:
        """The terminal stages' chunks, in arrival order, until the request ends (or raises)."""
        return (chunk async for _, chunk in self.stream())

    async def stream(self) -> AsyncIterator[tuple[str, Payload]]:
        """(terminal stage, chunk) pairs: a model with several terminals (a thinker's text and a
        voice's audio) tells its streams apart by the stage. Iterate once: chunks are consumed."""
        while True:
            item = await self._chunks.get()
            if item is _END:
                return
            if isinstance(item, PipelineError):
                raise item
            stage = item[0]
            if self._paced and stage in self._coordinator.paced_stages:
                taken = self._taken.get(stage, 0) + 1
                if taken >= CHUNK_WINDOW // 2:  # credit in batches: fewer messages
                    self._coordinator.credit(self._key, stage, taken)
                    taken = 0
                self._taken[stage] = taken
            yield item

    async def result(self) -> Any:
        if self._paced and not self._result.done():
            # nobody may read the chunks before the result: do not pace the stages on them
            self._paced = False
            for stage in self._coordinator.terminals_of(self._key):
                if stage in self._coordinator.paced_stages:
                    self._coordinator.credit(self._key, stage, UNLIMITED)
        return await asyncio.shield(self._result)

    async def abort(self) -> None:
        self._coordinator.abort(self._key)

    async def __aenter__(self) -> RequestHandle:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if not self.done:
            self._coordinator.abort(self._key)

    # ---- coordinator side
    def _chunk(self, stage: str, chunk: Payload) -> None:
        self._chunks.put_nowait((stage, chunk))

    def _finish(self, result: Any) -> None:
        if not self._result.done():
            self._result.set_result(result)
            self._chunks.put_nowait(_END)

    def _fail(self, error: PipelineError) -> None:
        if not self._result.done():
            self._result.set_exception(error)
            self._chunks.put_nowait(error)


@dataclass(eq=False)
class _Flight:
    handle: RequestHandle
    model: ModelSpec
    env: Envelope
    touched: tuple[int, ...]  # instances the request may reach
    expected: set[str]  # terminals that will report (a result or TerminalSkipped)
    single_terminal: str | None  # the model's only terminal (its payload is the result)
    skipped: set[str] = field(default_factory=set)
    results: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, tuple[float, float, float]] = field(default_factory=dict)


class Coordinator:
    """Requests in flight. Closed until open(links); close(reason) fails what is in flight and
    refuses new requests with that reason (as PipelineError "unavailable")."""

    def __init__(self, plan: Plan, observers: list[StageObserver]) -> None:
        self.plan = plan
        self.routes = Routes(plan)
        self.observers = observers
        self._links: Links | None = None
        self._closed_reason: str | None = "the pipeline is not started"
        self._flights: dict[int, _Flight] = {}
        self._keys = itertools.count(1)
        self._binder = ReplicaBinder(plan)
        # terminal stages whose chunks are paced by credits (stage/node.py: _TerminalItem)
        self.paced_stages = frozenset(s for s in plan.stages if plan.paced_by_credits(s))
        # who hears a stage's timeout report (the runtime: counts it, kills an overran
        # process); by default the requests just fail
        self.on_stage_timeout: Callable[[StageTimedOut], object] = lambda m: self.timed_out(
            m.keys, m.stage, m.timeout_s
        )

    def open(self, links: Links) -> None:
        """Start admitting requests; `links` reach the stage hosts."""
        self._links = links
        self._closed_reason = None

    def close(self, reason: str, *, fail_in_flight: bool = True) -> None:
        """Refuse new requests with `reason`; fail every request in flight with it, unless
        `fail_in_flight` is False (requests that can still finish are left to finish)."""
        self._closed_reason = reason
        if fail_in_flight:
            self.fail_all(PipelineError(reason, code="unavailable"))

    @property
    def accepting(self) -> bool:
        return self._closed_reason is None

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    @property
    def binder(self) -> ReplicaBinder:
        """Replica choice and which replicas are up (the runtime's supervision sets that)."""
        return self._binder

    def replica_load(self, process: str) -> tuple[int, ...]:
        """Requests in flight bound to each replica of a replicated process (a snapshot)."""
        return self._binder.load(process)

    def submit(
        self, model: ModelSpec, inputs: Payload, request_id: str | None = None
    ) -> RequestHandle:
        """Admit a request and hand it to the model's entry stage (call on the runtime's loop).

        Raises PipelineError("unavailable") when the pipeline is not running or unhealthy."""
        if self._closed_reason is not None or self._links is None:
            raise PipelineError(self._closed_reason or "not started", code="unavailable")
        if model.id not in self.routes.model_processes:
            raise PipelineError(f"model {model.id!r} is not in this pipeline", code="unavailable")
        if not isinstance(inputs, dict):
            raise TypeError(f"inputs must be a dict, got {type(inputs).__name__}")
        key = next(self._keys)
        request_id = request_id or uuid.uuid4().hex
        handle = RequestHandle(self, key, request_id)
        terminals = self.routes.terminals(model.id)
        bindings = self._binder.bind(self.routes.model_processes[model.id])
        env = Envelope(key, request_id, bindings, model.id)
        try:
            self._flights[key] = _Flight(
                handle=handle,
                model=model,
                env=env,
                touched=self.routes.touched(model, env.bindings),
                expected=terminals,
                single_terminal=next(iter(terminals)) if len(terminals) == 1 else None,
            )
            entry = self.routes.host_of(model.entry, env.bindings)
            self._links.to_instance(entry, Deliver(env, model.entry, "", inputs, []))
        except BaseException:  # not admitted (e.g. inputs the codec refuses): nothing was sent
            self._flights.pop(key, None)
            self._binder.release(env.bindings)
            raise
        return handle

    def _retire(self, flight: _Flight) -> None:
        """Take a flight out of the books, lowering its replicas' load once however often it
        is called (a flight may be failed by a message and by a death in one loop turn)."""
        if self._flights.pop(flight.env.key, None) is not None:
            self._binder.release(flight.env.bindings)

    def on_message(self, message: CoordinatorMessage) -> None:
        match message:
            case TerminalChunk():
                flight = self._flights.get(message.key)
                if flight is not None:
                    flight.handle._chunk(message.stage, message.chunk)
            case TerminalResult():
                flight = self._flights.get(message.key)
                if flight is not None:
                    flight.results[message.stage] = message.payload
                    self._record(flight, message.timings)
                    self._maybe_complete(flight)
            case TerminalSkipped():
                flight = self._flights.get(message.key)
                if flight is not None:
                    flight.skipped.add(message.stage)
                    self._maybe_complete(flight)
            case StageFailed():
                flight = self._flights.get(message.key)
                if flight is not None:
                    error = PipelineError(
                        message.message,
                        code="invalid_request" if message.invalid else "stage_failed",
                        stage=message.stage,
                        error_code=message.error_code,
                        param=message.param,
                    )
                    self._fail(flight, error)
            case StageTimedOut():
                self.on_stage_timeout(message)
            case _:
                raise TypeError(f"coordinator got an unknown message {type(message).__name__}")

    def _record(self, flight: _Flight, timings: Timings) -> None:
        for stage, queue_s, compute_s, lead_s in timings:
            flight.timings.setdefault(stage, (queue_s, compute_s, lead_s))

    def _maybe_complete(self, flight: _Flight) -> None:
        if not flight.expected <= flight.results.keys() | flight.skipped:
            return
        if not flight.results:
            skipped = ", ".join(sorted(flight.skipped))
            message = f"no result: route methods skipped every terminal stage ({skipped})"
            self._fail(flight, PipelineError(message, code="stage_failed"))
            return
        self._retire(flight)
        if flight.single_terminal is not None:
            result = flight.results[flight.single_terminal]
        else:
            result = dict(flight.results)
        flight.handle._finish(result)
        for stage, (queue_s, compute_s, lead_s) in flight.timings.items():
            for observer in self.observers:
                try:
                    observer(stage, queue_s, compute_s, lead_s)
                except Exception:  # a metrics bug must not break the request path
                    log.exception("stage observer %r failed", observer)

    def _fail(self, flight: _Flight, error: PipelineError) -> None:
        self._retire(flight)
        self._abort_everywhere(flight)
        flight.handle._fail(error)

    def _abort_everywhere(self, flight: _Flight, *, skip: int | None = None) -> None:
        for index in flight.touched:
            if index != skip and self.plan.instances[index].tp_rank == 0 and self._links:
                self._links.control(index, Abort((flight.env.key,)))

    def credit(self, key: int, stage: str, chunks: int) -> None:
        """Let terminal `stage` send `chunks` more chunks of request `key` (UNLIMITED: all)."""
        flight = self._flights.get(key)
        if flight is not None and self._links is not None:
            index = self.routes.host_of(stage, flight.env.bindings)
            self._links.control(index, Credit(key, stage, chunks))

    def terminals_of(self, key: int) -> tuple[str, ...]:
        flight = self._flights.get(key)
        return tuple(sorted(flight.expected)) if flight is not None else ()

    def abort(self, key: int) -> None:
        flight = self._flights.get(key)
        if flight is not None:
            self._fail(flight, PipelineError("request aborted", code="aborted"))

    def instance_died(self, index: int, message: str) -> None:
        """Fail every request that may have reached instance `index` (it is gone)."""
        for flight in [f for f in self._flights.values() if index in f.touched]:
            self._retire(flight)
            self._abort_everywhere(flight, skip=index)
            stages = self.plan.instances[index].stages
            stage = stages[0] if len(stages) == 1 else None
            flight.handle._fail(PipelineError(message, code="process_died", stage=stage))

    def timed_out(self, keys: tuple[int, ...], stage: str, timeout_s: float) -> int:
        """Fail these requests: they stayed at `stage` past its timeout_s. Returns how many were
        still in flight."""
        failed = 0
        for key in keys:
            flight = self._flights.get(key)
            if flight is not None:
                message = f"stage {stage}: no outcome within its timeout_s of {timeout_s:g} s"
                self._fail(flight, PipelineError(message, code="timeout", stage=stage))
                failed += 1
        return failed

    def fail_all(self, error: PipelineError) -> None:
        for flight in list(self._flights.values()):
            self._fail(flight, error)
