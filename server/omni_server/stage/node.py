"""One stage inside a stage host: inputs -> scheduler -> outputs.

Inputs: payloads along `next` edges (one, or one per `wait_for` stage, merged by the backend's
merge method) and chunks along `stream_to` edges. What a request waits for follows from its
model's reachable graph (its entry): upstreams it can never reach are not waited for.
- A stage that some reachable upstream hands a payload is admitted when that payload arrives
  (a fan-in stage: when every `wait_for` stage has sent its payload or was skipped). Exactly one
  payload may arrive per request: a second one fails the request with a message naming both
  senders (a stage fed by several upstreams merges them with `wait_for`).
- A stage fed only by streams (for this request) is admitted at its first stream message with
  empty inputs: the chunks carry what it needs (TTS: acoustic --stream_to--> encoder).
Its stream ends when every reachable streamer has sent its end marker (or was skipped).
Outputs: chunks go to every stream_to stage (and to the caller when terminal); at the end, the
end markers go along the stream_to edges, then the final payload to the chosen `next` stages
(and to the caller when terminal), and a `Skipped` notice to each `next` stage not chosen.

Skipping: a stage whose starters (its `wait_for`, else the upstreams that hand this request a
payload, else its streamers) all sent `Skipped` does not run: it sends `Skipped` to every
successor (which also ends its stream edges) and, when terminal, `TerminalSkipped` to the
coordinator. A fan-in stage counts a skipped upstream as arrived without a payload and merges
the payloads that came. So every stage a request can reach hears from each of its upstreams, and
nothing waits forever.

Same-process receivers get the very payload object; when it goes to several receivers each gets
its own shallow copy of the dict (isolated containers over shared, read-only values).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from omni_server.backend import InvalidRequest, Request, StageConfigError
from omni_server.compiler.plan import StageSpec
from omni_server.envelope import Envelope, Payload, Timings
from omni_server.wire.messages import (
    CHUNK_WINDOW,
    UNLIMITED,
    CoordinatorMessage,
    Deliver,
    HostMessage,
    Skipped,
    StageFailed,
    StageTimedOut,
    StreamChunk,
    StreamEnd,
    TerminalChunk,
    TerminalResult,
    TerminalSkipped,
)
from omni_server.wire.routes import Routes

from .compute import ComputeExecutor
from .deadlines import StageDeadlines
from .request_here import FanIn, RequestHere
from .scheduling import BackendContractError, StageCalls, WorkItem, make_scheduler
from .scheduling.oom import OutOfGPUMemory
from .streams import StreamInbox

log = logging.getLogger(__name__)


_DONE_MEMORY = 4096


@dataclass(frozen=True)
class _Inputs:
    """A stage's edges as requests of one model see them (stages outside the model do not
    exist for them: nothing is sent there, nothing is awaited from there)."""

    senders: frozenset[str]  # hand it a payload along next / route edges
    streamers: frozenset[str]  # stream chunks into it along stream_to edges
    stream_to: tuple[str, ...]  # where its chunks go
    visits: frozenset[str]  # every stage of the model

    @property
    def starters(self) -> frozenset[str]:
        """Whose messages start it (when all of them skip, the stage is skipped)."""
        return self.senders or self.streamers


@dataclass(eq=False)
class _TerminalItem(WorkItem):
    """A request at a terminal stage. Its chunks go to the caller, who may read slowly: it is
    runnable only while it has credit for another chunk (the coordinator returns credit as the
    consumer takes chunks), so a slow reader pauses its request here instead of piling chunks
    up in the server. UNLIMITED: the consumer only awaits the result."""

    credits: int = CHUNK_WINDOW

    @property
    def has_credit(self) -> bool:
        return self.credits != 0


class Outbox(Protocol):
    """What a stage needs of the host it runs in (`host.StageHost` is one): where its messages
    go, a task for work that outlives a callback, and which requests were aborted."""

    def send(self, env: Envelope, stage: str, message: HostMessage) -> None:
        """To `stage`, wherever this request's binding puts it (this process or another)."""

    def send_chunks(self, stage: str, chunks: list[StreamChunk]) -> None:
        """Chunks of several requests to `stage`: one message per process it goes to."""

    def to_coordinator(self, message: CoordinatorMessage) -> None:
        """Chunks, results, failures and timeouts for the caller's side."""

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` as a task of the host (cancelled when the host stops)."""

    def is_aborted(self, key: int) -> bool:
        """Whether request `key` was aborted in this process (its late messages are dropped)."""


class StageNode:
    """One stage of the pipeline DAG as hosted by one process instance (`instance`)."""

    def __init__(
        self,
        spec: StageSpec,
        calls: StageCalls,
        executor: concurrent.futures.ThreadPoolExecutor,
        *,
        outbox: Outbox,
        routes: Routes,
        instance: str,
        timeout_s: float | None,
    ) -> None:
        """`routes`: the plan's edges as requests of each model see them; `instance`: the name
        of the hosting instance (for timeout reports); `timeout_s`: the stage's timeout_s."""
        self.outbox = outbox
        self.instance = instance
        self.spec = spec
        self.name = spec.name
        self.calls = calls
        self.executor = executor
        self.scheduler = make_scheduler(spec.scheduler, calls, self, executor)
        self._routes = routes
        self._paced = routes.plan.paced_by_credits(spec.name)  # terminal chunks: _TerminalItem
        self._inputs: dict[str, _Inputs] = {}  # per model: this stage's edges
        self._here: dict[int, RequestHere] = {}  # every request with state here, by key
        # Two bounded memories outside a request's life here, so neither can grow without end:
        # requests finished (or skipped: "") here -> who started them, so a late stream message
        # does not start them again and a second payload is refused naming the first sender;
        self._done: collections.OrderedDict[int, str] = collections.OrderedDict()
        # credits that came before the request was admitted here (control overtakes data)
        self._early_credits: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.deadlines: StageDeadlines | None = None
        if timeout_s is not None and isinstance(executor, ComputeExecutor):
            self.deadlines = StageDeadlines(
                timeout_s, executor, self._timed_out, self._overran, self.scheduler.finish
            )

    # ---- inputs (event-loop thread) --------------------------------------------------------

    def inputs(self, model: str) -> _Inputs:
        """What this stage waits for from a request of `model` (cached per model)."""
        found = self._inputs.get(model)
        if found is None:
            routes_, name = self._routes, self.name
            senders = routes_.reached(routes_.next_preds[name], model)
            streamers = routes_.reached(routes_.stream_preds[name], model)
            visits = routes_.visits(model)
            stream_to = tuple(s for s in self.spec.stream_to if s in visits)
            found = self._inputs[model] = _Inputs(senders, streamers, stream_to, visits)
        return found

    def _here_of(self, key: int) -> RequestHere:
        """The request's record here, made by its first message."""
        here = self._here.get(key)
        if here is None:
            here = self._here[key] = RequestHere()
        return here

    def _admitted(self, key: int) -> bool:
        here = self._here.get(key)
        return here is not None and here.item is not None

    def on_deliver(self, msg: Deliver) -> None:
        key = msg.env.key
        if self.spec.wait_for:
            fan_in = self._fan_in_of(key)
            fan_in.payloads[msg.source] = msg.payload
            fan_in.timings.extend(msg.timings)
            self._fan_in_step(msg.env, fan_in)
            return
        here = self._here.get(key)
        first = (here.started_by if here is not None else None) or self._done.get(key)
        if first is not None:
            self._report_failure(
                key,
                BackendContractError(
                    f"a second payload for one request (from {msg.source}, after {first}): a "
                    "stage fed by several upstreams declares wait_for and merge"
                ),
            )
            return
        self._admit(msg.env, msg.payload, msg.timings, msg.source)

    def on_skipped(self, msg: Skipped) -> None:
        key = msg.env.key
        if key in self._done:
            return
        inputs = self.inputs(msg.env.model)
        if msg.source in inputs.streamers:
            # a skipped streamer sends nothing more; after a route skip the edge already ended
            self._inbox(msg.env).end(msg.source, [])
            self.scheduler.wake()
        if self.spec.wait_for:
            fan_in = self._fan_in_of(key)
            fan_in.skipped.add(msg.source)
            self._fan_in_step(msg.env, fan_in)
            return
        if self._admitted(key):
            return  # its start came from a streamer that still runs
        skipped = self._here_of(key).skips
        skipped.add(msg.source)
        if skipped >= inputs.starters:
            self._skip(msg.env)

    def _fan_in_of(self, key: int) -> FanIn:
        here = self._here_of(key)
        if here.fan_in is None:
            here.fan_in = FanIn()
        return here.fan_in

    def _fan_in_step(self, env: Envelope, fan_in: FanIn) -> None:
        arrived = fan_in.payloads.keys() | fan_in.skipped
        if not arrived >= set(self.spec.wait_for):
            return
        self._here_of(env.key).fan_in = None  # complete: merged next (the record stays)
        if fan_in.payloads:
            self.outbox.spawn(self._merge(env, fan_in))
        else:
            self._skip(env)

    def _skip(self, env: Envelope) -> None:
        """Every payload sender skipped this stage: do not run, pass the skip on."""
        spec = self.spec
        self._end(env.key)  # late stream chunks from live streamers are dropped
        visits = self.inputs(env.model).visits
        for dst in dict.fromkeys((*spec.next, *spec.stream_to)):
            if dst in visits:
                self.outbox.send(env, dst, Skipped(env, dst, self.name))
        if spec.terminal:
            self.outbox.to_coordinator(TerminalSkipped(env.key, self.name))

    async def _merge(self, env: Envelope, fan_in: FanIn) -> None:
        request = Request(id=env.id, inputs={})
        loop = asyncio.get_running_loop()
        try:
            merged = await loop.run_in_executor(
                self.executor, self.calls.merge, request, fan_in.payloads
            )
        except Exception as exc:  # noqa: BLE001 - the merge method raised: fail this request
            self.abort(env.key)
            self._report_failure(env.key, exc)
            return
        if self.outbox.is_aborted(env.key):
            return
        self._admit(env, merged, fan_in.timings, "merge")

    def on_chunk(self, msg: StreamChunk) -> None:
        if msg.env.key in self._done:
            return
        self._inbox(msg.env).put(msg.chunk)
        self._start_on_stream(msg)
        self.scheduler.wake()

    def on_stream_end(self, msg: StreamEnd) -> None:
        if msg.env.key in self._done:
            return
        self._inbox(msg.env).end(msg.source, msg.timings)
        self._start_on_stream(msg)
        self.scheduler.wake()

    def _start_on_stream(self, msg: StreamChunk | StreamEnd) -> None:
        """A stage fed only by streams starts at the first stream message."""
        if self.spec.wait_for or self._admitted(msg.env.key):
            return
        if not self.inputs(msg.env.model).senders:
            self._admit(msg.env, {}, [], msg.source)

    def _inbox(self, env: Envelope) -> StreamInbox:
        here = self._here_of(env.key)
        if here.inbox is None:
            here.inbox = StreamInbox(env.id, self.inputs(env.model).streamers)
        return here.inbox

    def _admit(self, env: Envelope, inputs: Payload, timings: Timings, source: str) -> None:
        inbox = self._inbox(env) if self.inputs(env.model).streamers else None
        request = Request(
            id=env.id,
            inputs=inputs,
            _stream=iter(inbox) if inbox else None,
            _take=inbox.take if inbox else None,
        )
        item: WorkItem
        if self._paced:
            credits = self._early_credits.pop(env.key, CHUNK_WINDOW)
            item = _TerminalItem(env, request, timings, stream=inbox, credits=credits)
        else:
            item = WorkItem(env=env, request=request, timings=timings, stream=inbox)
        here = self._here_of(env.key)
        here.skips.clear()
        here.item = item
        here.started_by = source or "the caller"
        if self.deadlines is not None:
            self.deadlines.start(env.key)
        self.scheduler.admit(item)

    # ---- what this stage holds (for leak checks: an ended request must leave nothing) --------

    def holds(self, key: int) -> bool:
        """Whether request `key` still has state here: admitted, waiting for payloads or stream
        input, counting chunks, or in the scheduler. False once it ended or was aborted here
        (what remains then is the bounded memory of finished keys, `_done`)."""
        return key in self._here or key in self.scheduler.active_keys

    @property
    def idle(self) -> bool:
        """No request has state here (see holds)."""
        return not self._here and not self.scheduler.active_keys

    def abort_all(self) -> None:
        """Abort every request admitted here (the host is stopping)."""
        for key in [k for k, here in self._here.items() if here.item is not None]:
            self.abort(key)

    def on_credit(self, key: int, chunks: int) -> None:
        """The caller took `chunks` chunks of request `key` (UNLIMITED: it will not pace)."""
        here = self._here.get(key)
        item = here.item if here is not None else None
        if isinstance(item, _TerminalItem):
            unlimited = chunks == UNLIMITED or item.credits == UNLIMITED
            item.credits = UNLIMITED if unlimited else item.credits + chunks
            self.scheduler.wake()
        elif item is None and key not in self._done:
            early = self._early_credits.get(key, CHUNK_WINDOW)
            unlimited = chunks == UNLIMITED or early == UNLIMITED
            self._early_credits[key] = UNLIMITED if unlimited else early + chunks
            if len(self._early_credits) > _DONE_MEMORY:
                self._early_credits.popitem(last=False)

    def abort(self, key: int) -> None:
        """Drop request `key` here: its record, its work in the scheduler, its stream."""
        self._early_credits.pop(key, None)
        if self.deadlines is not None:
            self.deadlines.stop(key)
        here = self._here.pop(key, None)
        if here is None:
            return
        if here.item is not None:
            here.item.request.abort()
            self.scheduler.abort(key)
        if here.inbox is not None:
            here.inbox.abort()

    # ---- timeouts (deadlines.py, event-loop thread) ------------------------------------------

    def _timed_out(self, key: int, overran: bool) -> None:
        """Request `key` stayed here past timeout_s: drop it here, let the coordinator fail it
        (and, when a backend call overran, kill this process)."""
        assert self.deadlines is not None
        self.abort(key)
        log.warning(
            "stage %s: request %d timed out (%g s)", self.name, key, self.deadlines.timeout_s
        )
        self._report_timeout((key,), overran)

    def _overran(self) -> None:
        assert self.deadlines is not None
        log.error(
            "stage %s: a backend call has run past timeout_s (%g s); its thread cannot be "
            "stopped, asking the supervisor to restart this process",
            self.name,
            self.deadlines.timeout_s,
        )
        self._report_timeout((), True)

    def _report_timeout(self, keys: tuple[int, ...], overran: bool) -> None:
        assert self.deadlines is not None
        timeout = self.deadlines.timeout_s
        self.outbox.to_coordinator(StageTimedOut(self.instance, self.name, keys, timeout, overran))

    # ---- outcomes (StageCallbacks, event-loop thread) --------------------------------------

    def chunk(self, item: WorkItem, chunk: Payload) -> None:
        self.chunks([(item, chunk)])

    def chunks(self, batch: list[tuple[WorkItem, Payload]]) -> None:
        """Chunks of several requests from one step, in order: each stream_to stage gets them
        in one send_chunks (one message per destination process, not one per request)."""
        spec = self.spec
        edges: dict[str, list[StreamChunk]] = {}
        for item, chunk in batch:
            here = self._here.get(item.key)
            seq = 0 if here is None else here.seq
            if here is not None:
                here.seq += 1
            env = item.env
            stream_to = self.inputs(env.model).stream_to
            copies = _isolated(chunk, len(stream_to) + spec.terminal)
            for dst in stream_to:
                message = StreamChunk(env, dst, self.name, seq, next(copies))
                edges.setdefault(dst, []).append(message)
            caller = _for_caller(next(copies)) if spec.terminal else {}
            if spec.terminal and (caller or not chunk):  # stage-only parts reach no caller
                if isinstance(item, _TerminalItem) and item.credits > 0:
                    item.credits -= 1
                self.outbox.to_coordinator(TerminalChunk(item.key, self.name, seq, caller))
        for dst, chunks in edges.items():
            self.outbox.send_chunks(dst, chunks)

    def complete(self, item: WorkItem, payload: Payload | None, targets: tuple[str, ...]) -> None:
        key, env, spec = item.key, item.env, self.spec
        here = self._end(key)
        inbox = here.inbox if here is not None else None
        timings = [*item.timings, *(inbox.timings if inbox else ()), self._timing(item)]
        edges = self.inputs(env.model)
        for dst in edges.stream_to:
            self.outbox.send(env, dst, StreamEnd(env, dst, self.name, timings))
        targets = tuple(t for t in targets if t in edges.visits)  # the model's own stages
        copies = _isolated(payload, len(targets) + spec.terminal)
        if spec.terminal:
            self.outbox.to_coordinator(TerminalResult(key, self.name, next(copies), timings))
        for dst in targets:
            self.outbox.send(env, dst, Deliver(env, dst, self.name, next(copies), timings))
        for dst in spec.next:
            # the route left it out: it must not wait for this payload
            if dst not in targets and dst in edges.visits:
                self.outbox.send(env, dst, Skipped(env, dst, self.name))

    def _end(self, key: int) -> RequestHere | None:
        """The request ended here (completed or skipped): its record goes, who started it is
        remembered in `_done`."""
        if self.deadlines is not None:
            self.deadlines.stop(key)
        here = self._here.pop(key, None)
        self._done[key] = here.started_by if here is not None else ""
        if len(self._done) > _DONE_MEMORY:
            self._done.popitem(last=False)
        return here

    def fail(self, item: WorkItem, error: BaseException) -> None:
        self.abort(item.key)
        self._report_failure(item.key, error)

    def _report_failure(self, key: int, error: BaseException) -> None:
        if isinstance(error, InvalidRequest):  # the caller's input: no stack trace, its words
            log.info("stage %s refused request %d: %s", self.name, key, error.message)
            failed = StageFailed(key, self.name, error.message, True, error.code, error.param)
            self.outbox.to_coordinator(failed)
            return
        message = describe(error)
        log.warning("stage %s failed request %d: %s", self.name, key, message, exc_info=error)
        code = error.code if isinstance(error, OutOfGPUMemory) else None  # the 500 names it
        failed = StageFailed(key, self.name, f"stage {self.name}: {message}", error_code=code)
        self.outbox.to_coordinator(failed)

    def _timing(self, item: WorkItem) -> tuple[str, float, float, float]:
        return (self.name, item.queue_s, item.compute_s, item.min_lead_s)


def _for_caller(chunk: Payload) -> Payload:
    """A terminal chunk as the caller gets it: without the contracts that cross between
    stages only (Contract.STAGES_ONLY: what a stream_to stage reads, not the client)."""
    return {k: v for k, v in chunk.items() if not getattr(type(v), "STAGES_ONLY", False)}


def _isolated(payload: Any, receivers: int) -> Any:
    """Yield the payload once per receiver: itself for one, a shallow dict copy for each of many."""
    if receivers <= 1 or not isinstance(payload, dict):
        while True:
            yield payload
    while True:
        yield dict(payload)


_PLAIN = (Exception, RuntimeError, ValueError, BackendContractError, StageConfigError)


def describe(error: BaseException) -> str:
    """What went wrong, for the caller: the message, prefixed by the type unless it is generic."""
    text = str(error)
    if type(error) in _PLAIN and text:
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
