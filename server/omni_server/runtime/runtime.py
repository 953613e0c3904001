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

from omni_server.envelope import Payload
from omni_server.repository.plan import ModelSpec, Plan

from .coordinator import Coordinator, RequestHandle, StageObserver
from .errors import PipelineError
from .host import StageHost, StageStartError
from .links import InlineLinks
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
        self.coordinator = Coordinator(plan, self.stage_observers)
        if inline and any(i.tp_size > 1 for i in plan.instances):
            raise ValueError("inline placement cannot host tensor-parallel stages")

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
                self.coordinator.open(self._group.links)
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

    async def _start_inline(self) -> None:
        topology = Topology(self.plan)
        self._hosts = [None] * len(self.plan.instances)
        links = InlineLinks(self.coordinator, self._hosts)
        for index in range(len(self.plan.instances)):
            host = StageHost(self.plan, index, links, topology=topology)
            self._hosts[index] = host
            await host.start()
        self.coordinator.open(links)

    async def stop(self) -> None:
        """Stop everything; idempotent. Requests still in flight fail as unavailable."""
        if self._state == "stopped":
            return
        self._state = "stopped"
        await self._stop_everything()

    async def _stop_everything(self) -> None:
        self._state = "stopped"
        self.coordinator.close("the pipeline is stopped")
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
        self.coordinator.instance_died(index, message)  # its requests fail as process_died
        self.coordinator.close(f"pipeline unhealthy: {message}", fail_in_flight=False)

    def _broken(self, message: str) -> None:
        log.error("pipeline unhealthy: %s", message)
        self._unhealthy = message
        self.coordinator.close(f"pipeline unhealthy: {message}")
