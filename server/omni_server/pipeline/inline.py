"""The in-process pipeline: every instance's stage host on the caller's event loop, beside the
coordinator, for tests and tools (backends still run on their own compute threads; no TP).

This is the one module of the pipeline room (the server process's side) that imports the stage
room (the stage host): everywhere else the two meet only through the wire's messages and
`Links`. It lives inside the pipeline package, so importing it never re-enters the package's
`__init__` (which imports `runtime`, which imports this module) half-way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from omni_server.compiler.plan import Plan
from omni_server.errors import PipelineError
from omni_server.stage.host import StageHost, StageStartError
from omni_server.stage.node import StageNode
from omni_server.wire.messages import CoordinatorMessage, HostMessage
from omni_server.wire.routes import Routes

from .coordinator import Coordinator


class InlineLinks:
    """`Links` on one loop: a message is the object itself, handed over on the next loop turn
    (never re-entrantly); `hosts[i]` is None until it is built."""

    def __init__(self, coordinator: Coordinator, hosts: Sequence[StageHost | None]) -> None:
        self._coordinator = coordinator
        self._hosts = hosts
        self._loop = asyncio.get_running_loop()

    def to_instance(self, index: int, message: HostMessage) -> None:
        host = self._hosts[index]
        if host is not None:
            self._loop.call_soon(host.handle, message)

    control = to_instance  # one loop: nothing for control to overtake

    def to_coordinator(self, message: CoordinatorMessage) -> None:
        self._loop.call_soon(self._coordinator.on_message, message)


class InlinePipeline:
    """The stage hosts of every plan instance, started in order on the running loop."""

    def __init__(self, plan: Plan, coordinator: Coordinator) -> None:
        if any(i.tp_size > 1 for i in plan.instances):
            raise ValueError("inline placement cannot host tensor-parallel stages")
        self.plan = plan
        self._coordinator = coordinator
        self._hosts: list[StageHost | None] = []

    async def start(self) -> None:
        """Build and start every host, then open the coordinator on them. A stage that cannot
        start raises PipelineError("unavailable") naming it; the caller stops what started."""
        routes = Routes(self.plan)
        self._hosts = [None] * len(self.plan.instances)
        links = InlineLinks(self._coordinator, self._hosts)
        for index in range(len(self.plan.instances)):
            host = StageHost(self.plan, index, links, routes=routes)
            self._hosts[index] = host
            try:
                await host.start()
            except StageStartError as exc:
                raise PipelineError(str(exc), code="unavailable") from exc
        self._coordinator.open(links)

    async def stop(self) -> None:
        for host in self._hosts:
            if host is not None:
                await host.stop()
        self._hosts = []

    # ---- the seam for tests and tools: what runs where, in this process ------------------

    @property
    def hosts(self) -> tuple[StageHost, ...]:
        """The started hosts, in plan-instance order."""
        return tuple(h for h in self._hosts if h is not None)

    def stage(self, name: str, replica: int = 0) -> StageNode:
        """The stage `name` as hosted by `replica` of its process."""
        for host in self.hosts:
            if host.instance.replica == replica and name in host.stages:
                return host.stages[name]
        raise KeyError(f"no started host of stage {name} replica {replica}")

    def backend(self, name: str, replica: int = 0) -> Any:
        """The backend object of stage `name` (the one its model.py's class made)."""
        return self.stage(name, replica).calls.backend
