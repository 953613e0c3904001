"""Runtime: the processes and the coordinator of one compiled plan.

Two placements, one code path for stages:
- `inline=True`: every instance's stage host runs on the caller's event loop in this process
  (backends still run on their own compute threads). For tests and tools; no TP.
- default: one OS process per plan instance (`processes.ProcessGroup`), with the coordinator
  here on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from omni_server.repository.plan import ModelSpec, Plan

from .coordinator import Coordinator, RequestHandle, StageObserver
from .errors import PipelineError
from .host import StageHost, StageStartError
from .messages import CoordinatorMessage, HostMessage, Payload
from .topology import Topology

log = logging.getLogger(__name__)


class Runtime:
    """Owns the processes and the coordinator for one plan."""

    def __init__(
        self,
        plan: Plan,
        *,
        run_dir: Path | None = None,
        inline: bool = False,
        ring_capacity: int = 8 << 20,
        start_timeout: float = 300.0,
    ) -> None:
        self.plan = plan
        self.stage_observers: list[StageObserver] = []
        self._inline = inline
        self._run_dir = run_dir
        self._ring_capacity = ring_capacity
        self._start_timeout = start_timeout
        self._hosts: list[StageHost | None] = []
        self._group: Any = None  # processes.ProcessGroup
        self._state = "new"  # new -> starting -> running -> stopped
        self._unhealthy: str | None = None
        self.coordinator = Coordinator(plan, self._links(), self.stage_observers)
        if inline and any(i.tp_size > 1 for i in plan.instances):
            raise ValueError("inline placement cannot host tensor-parallel stages")

    def _links(self) -> Any:
        return _InlineCoordinatorLinks(self) if self._inline else _GroupCoordinatorLinks(self)

    @property
    def ready(self) -> bool:
        return self._state == "running"

    @property
    def healthy(self) -> bool:
        return self._state == "running" and self._unhealthy is None

    @property
    def run_dir(self) -> Path | None:
        return self._group.run_dir if self._group is not None else None

    def processes(self) -> dict[str, int]:
        """Instance name -> pid of every live stage process (empty when inline)."""
        return self._group.pids() if self._group is not None else {}

    async def start(self) -> None:
        if self._state != "new":
            raise RuntimeError(f"runtime already {self._state}")
        self._state = "starting"
        try:
            if self._inline:
                await self._start_inline()
            else:
                from .processes import ProcessGroup

                self._group = ProcessGroup(
                    self.plan,
                    on_message=self.coordinator.on_message,
                    on_death=self._instance_died,
                    on_broken=self._broken,
                    run_dir=self._run_dir,
                    ring_capacity=self._ring_capacity,
                )
                await asyncio.wait_for(self._group.start(), self._start_timeout)
        except (StageStartError, PipelineError) as exc:
            await self._stop_everything()
            raise PipelineError(str(exc), code="unavailable") from exc
        except TimeoutError as exc:
            await self._stop_everything()
            raise PipelineError(
                f"stages not ready after {self._start_timeout:g} s", code="unavailable"
            ) from exc
        except BaseException:
            await self._stop_everything()
            raise
        self._state = "running"
        self.coordinator.accepting = True

    async def _start_inline(self) -> None:
        topology = Topology(self.plan)
        links = _InlineHostLinks(self)
        self._hosts = [None] * len(self.plan.instances)
        for index in range(len(self.plan.instances)):
            host = StageHost(self.plan, index, links, topology=topology)
            self._hosts[index] = host
            await host.start()

    async def stop(self) -> None:
        """Stop everything; idempotent. Requests still in flight fail as unavailable."""
        if self._state == "stopped":
            return
        self._state = "stopped"
        await self._stop_everything()

    async def _stop_everything(self) -> None:
        self._state = "stopped"
        self.coordinator.accepting = False
        self.coordinator.unavailable_reason = "the pipeline is stopped"
        self.coordinator.fail_all(PipelineError("the pipeline stopped", code="unavailable"))
        for host in self._hosts:
            if host is not None:
                await host.stop()
        self._hosts = []
        if self._group is not None:
            await self._group.stop()

    def submit(
        self, model: ModelSpec, inputs: Payload, request_id: str | None = None
    ) -> RequestHandle:
        """Start a request of `model` (on the loop that started the runtime); see RequestHandle.

        `inputs` is handed to the entry stage as `request.inputs` (read-only from then on)."""
        return self.coordinator.submit(model, inputs, request_id)

    def _instance_died(self, index: int, exitcode: int | None) -> None:
        name = self.plan.instances[index].name
        message = f"process {name} exited with code {exitcode}"  # processes.py logged it
        self._unhealthy = message
        self.coordinator.accepting = False
        self.coordinator.unavailable_reason = f"pipeline unhealthy: {message}"
        self.coordinator.instance_died(index, message)

    def _broken(self, message: str) -> None:
        log.error("pipeline unhealthy: %s", message)
        self._unhealthy = message
        self.coordinator.accepting = False
        self.coordinator.unavailable_reason = f"pipeline unhealthy: {message}"
        self.coordinator.fail_all(PipelineError(message, code="unavailable"))


class _InlineHostLinks:
    """Messages between inline hosts and the coordinator: the objects themselves, on the loop."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._loop = asyncio.get_running_loop()

    def to_instance(self, index: int, message: HostMessage) -> None:
        host = self._runtime._hosts[index]
        if host is not None:
            self._loop.call_soon(host.handle, message)

    def to_coordinator(self, message: CoordinatorMessage) -> None:
        self._loop.call_soon(self._runtime.coordinator.on_message, message)


class _InlineCoordinatorLinks:
    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def deliver(self, index: int, message: HostMessage) -> None:
        host = self._runtime._hosts[index]
        if host is not None:
            asyncio.get_running_loop().call_soon(host.handle, message)

    control = deliver


class _GroupCoordinatorLinks:
    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def deliver(self, index: int, message: HostMessage) -> None:
        self._runtime._group.deliver(index, message)

    def control(self, index: int, message: HostMessage) -> None:
        self._runtime._group.control(index, message)
