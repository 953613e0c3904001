"""A stage host: the stages of one process instance, on one asyncio loop.

The host turns each incoming message into a call on the stage it names, sends each outgoing
message either to a stage it hosts (a direct call: the object itself is passed) or through its
`Links` to another instance or the coordinator, and remembers aborted requests so that their
late messages are dropped. It never looks at how a link moves bytes.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from omni_server.backend import StageConfigError, StageContext
from omni_server.compiler.plan import Plan, StageSpec
from omni_server.envelope import Envelope
from omni_server.wire.codec import Unencodable
from omni_server.wire.links import Links
from omni_server.wire.messages import (
    MAX_BATCHED_CHUNKS,
    Abort,
    CoordinatorMessage,
    Credit,
    Deliver,
    HostMessage,
    MalformedMessage,
    Shutdown,
    Skipped,
    StageFailed,
    StreamChunk,
    StreamChunks,
    StreamEnd,
    split_chunks,
)
from omni_server.wire.routes import Routes

from . import budgets
from .backends import load_backend
from .compute import ComputeExecutor
from .node import StageNode
from .scheduling import StageCalls
from .scheduling.oom import is_out_of_memory

log = logging.getLogger(__name__)

_ABORT_MEMORY = 65536  # aborted keys remembered to drop late messages (oldest forgotten first)


class StageStartError(Exception):
    """A stage could not start; the message names the stage."""


CallsFactory = Callable[[StageSpec, Any], StageCalls]


class StageHost:
    def __init__(
        self,
        plan: Plan,
        index: int,
        links: Links,
        *,
        routes: Routes | None = None,
        process_group: Any = None,
        calls_factory: CallsFactory = StageCalls,
        weight_sharing: Any = None,
        prepared_dir: Path | None = None,
    ) -> None:
        """`weight_sharing`: the process's `runtime.weights.WeightSharing`, if it is in a
        sharing group (the worker makes it); the host closes it after finalize.
        `prepared_dir`: the run's directory for prepared weights (StageContext.prepared_dir)."""
        self.plan = plan
        self.index = index
        self.instance = plan.instances[index]
        self.links = links
        self.routes = routes or Routes(plan)
        self.stages: dict[str, StageNode] = {}
        self.shutdown_requested = asyncio.Event()
        self._process_group = process_group
        self._weight_sharing = weight_sharing
        self._prepared_dir = prepared_dir
        self._calls_factory = calls_factory
        self._backends: dict[str, Any] = {}
        self._executors: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._aborted: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._budgets_enforced = False  # stage/budgets.py, before the first backend loads

    # ---- life cycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Load and initialize every stage's backend, then start its scheduler."""
        for name in self.instance.stages:
            backend = await self.initialize_backend(name)
            spec = self.plan.stages[name]
            calls = self._calls_factory(spec, backend)
            node = StageNode(
                spec,
                calls,
                self._executors[name],
                outbox=self,
                routes=self.routes,
                instance=self.instance.name,
                timeout_s=self.plan.timeout_of(name),
            )
            self.stages[name] = node
            self.spawn(node.scheduler.run())

    async def initialize_backend(self, stage: str) -> Any:
        """Give `stage` its compute thread, load its backend class and call initialize() there.

        start() does this for every stage; a TP peer rank, which runs no scheduler, calls it for
        its one stage alone. Raises StageStartError naming the stage."""
        spec = self.plan.stages[stage]
        device = self.instance.devices.get(spec.name)
        # the initializer binds every compute thread of the stage (a first-chunk lane too)
        executor = ComputeExecutor(
            f"stage-{stage}", initializer=bind_thread_to_device, initargs=(device,)
        )
        self._executors[stage] = executor
        context = StageContext(
            stage=spec.name,
            parameters=dict(spec.parameters),
            device="cpu" if device is None else f"cuda:{device}",
            repository=self.plan.repository,
            stage_dir=spec.directory,
            replica=self.instance.replica,
            tp_rank=self.instance.tp_rank,
            tp_size=self.instance.tp_size,
            process_group=self._process_group,
            engine=dict(spec.engine.settings) if spec.engine else {},
            gpu_memory_fraction=spec.gpu_memory_fraction if device is not None else None,
            repository_parameters=dict(self.plan.parameters),
            models=self.plan.models_through(spec.name),
            weight_sharing=self._weight_sharing,
            prepared_dir=self._prepared_dir,
        )

        def create() -> Any:
            self._enforce_budgets()  # the first stage's thread: before any backend allocates
            backend = load_backend(spec)
            bind_thread_to_device(device)
            backend.initialize(context)
            return backend

        loop = asyncio.get_running_loop()
        try:
            backend = await loop.run_in_executor(executor, create)
        except StageConfigError as exc:
            raise StageStartError(f"stage {spec.name}: {exc}") from exc
        except budgets.BudgetError as exc:  # names its stage
            raise StageStartError(str(exc)) from exc
        except Exception as exc:
            if is_out_of_memory(exc):  # one line, not torch's paragraph
                fraction = context.gpu_memory_fraction
                why = budgets.initialize_oom(fraction, device, str(exc))
                raise StageStartError(f"stage {spec.name}: {why}") from exc
            raise StageStartError(
                f"stage {spec.name}: initialize failed: {type(exc).__name__}: {exc}"
            ) from exc
        self._backends[spec.name] = backend
        return backend

    def _enforce_budgets(self) -> None:
        """Cap the allocator at the process's memory budget on each of its GPUs, once."""
        if not self._budgets_enforced:
            self._budgets_enforced = True
            budgets.enforce(self.instance, self.plan.stages)

    async def stop(self) -> None:
        """Abort what is in flight, stop the schedulers, finalize the backends."""
        for node in self.stages.values():
            node.abort_all()
            if node.deadlines is not None:
                node.deadlines.stop_all()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        loop = asyncio.get_running_loop()
        for name, node in self.stages.items():
            try:
                await loop.run_in_executor(self._executors[name], node.calls.finalize)
            except Exception:
                log.exception("stage %s: finalize failed", name)
        self._backends.clear()
        if self._weight_sharing is not None:  # after finalize: no backend call runs any more
            self._weight_sharing.close()
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # a bug in the host itself: this process can no longer be trusted
            log.error("stage host %s: task failed", self.instance.name, exc_info=task.exception())
            self.shutdown_requested.set()

    # ---- messages ------------------------------------------------------------------------

    def handle(self, message: HostMessage) -> None:
        """Dispatch one incoming message (event-loop thread)."""
        match message:
            case Deliver():
                if message.env.key not in self._aborted:
                    self.stages[message.stage].on_deliver(message)
            case Skipped():
                if message.env.key not in self._aborted:
                    self.stages[message.stage].on_skipped(message)
            case StreamChunk():
                if message.env.key not in self._aborted:
                    self.stages[message.stage].on_chunk(message)
            case StreamChunks():
                node = self.stages.get(message.stage)
                if node is None:
                    raise MalformedMessage(f"StreamChunks for {message.stage!r}: not hosted here")
                for chunk in split_chunks(message):  # checked whole before any is delivered
                    if chunk.env.key not in self._aborted:
                        node.on_chunk(chunk)
            case StreamEnd():
                if message.env.key not in self._aborted:
                    self.stages[message.stage].on_stream_end(message)
            case Abort():
                for key in message.keys:
                    self._remember_abort(key)
                    for node in self.stages.values():
                        node.abort(key)
            case Credit():
                if message.key not in self._aborted and message.stage in self.stages:
                    self.stages[message.stage].on_credit(message.key, message.chunks)
            case Shutdown():
                self.shutdown_requested.set()
            case _:
                raise TypeError(f"stage host got an unknown message {type(message).__name__}")

    def is_aborted(self, key: int) -> bool:
        return key in self._aborted

    def _remember_abort(self, key: int) -> None:
        self._aborted[key] = None
        if len(self._aborted) > _ABORT_MEMORY:
            self._aborted.popitem(last=False)

    def send(self, env: Envelope, stage: str, message: HostMessage) -> None:
        """Send a message to `stage`, wherever this request's binding puts it."""
        index = self.routes.host_of(stage, env.bindings)
        if index == self.index:
            self.handle(message)
            return
        try:
            self.links.to_instance(index, message)
        except Unencodable as exc:
            self._unencodable(env.key, getattr(message, "source", stage), stage, exc)

    def send_chunks(self, stage: str, chunks: list[StreamChunk]) -> None:
        """One step's chunks of several requests to `stage`: those hosted here are handled at
        once; each other process that hosts `stage` for some of them gets them as one
        StreamChunks (a lone chunk goes as itself), in their order."""
        remote: dict[int, list[StreamChunk]] = {}
        for chunk in chunks:
            index = self.routes.host_of(stage, chunk.env.bindings)
            if index == self.index:
                self.handle(chunk)
            else:
                remote.setdefault(index, []).append(chunk)
        for index, group in remote.items():
            for start in range(0, len(group), MAX_BATCHED_CHUNKS):
                self._send_batch(index, stage, group[start : start + MAX_BATCHED_CHUNKS])

    def _send_batch(self, index: int, stage: str, group: list[StreamChunk]) -> None:
        if len(group) == 1:
            self.send(group[0].env, stage, group[0])
            return
        try:
            self.links.to_instance(index, StreamChunks(stage, group[0].source, tuple(group)))
        except Unencodable:
            # nothing was sent: one by one, so only the chunk that cannot cross fails its request
            for chunk in group:
                self.send(chunk.env, stage, chunk)

    def to_coordinator(self, message: CoordinatorMessage) -> None:
        try:
            self.links.to_coordinator(message)
        except Unencodable as exc:
            key, stage = getattr(message, "key", None), getattr(message, "stage", "?")
            if key is None:
                raise
            self._unencodable(key, stage, "the caller", exc)

    def _unencodable(self, key: int, stage: str, to: str, exc: Unencodable) -> None:
        """A payload that cannot cross processes fails its request, never this process."""
        message = f"stage {stage}: its output for {to} cannot cross processes ({exc})"
        log.warning("request %d: %s", key, message)
        self.links.to_coordinator(StageFailed(key, stage, message))


def bind_thread_to_device(device: int | None) -> None:
    """Make `device` the current CUDA device of this thread (each stage has its own compute
    thread, and torch's current device is per thread). Nothing for CPU stages or without torch."""
    torch = sys.modules.get("torch")
    if device is not None and torch is not None and torch.cuda.is_available():
        torch.cuda.set_device(device)
