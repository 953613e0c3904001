"""One generation of a model group: a compiled part of the repository and the runtime running it.

A reload never changes a running generation: it starts a new one beside it (its own stage
processes, run directory and shared-memory segments, so nothing of the two can collide), moves
the group's models to it once every new process is ready, and drains the old one: the requests
already submitted to it finish there (streams are not cut), then its processes stop and its
run directory and segments go. A request is pinned to the generation it was submitted to: its
handle belongs to that generation's coordinator.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_server.compiler.plan import EMPTY, FrozenMap, ModelSpec, Plan, ServerOptions

from .runtime import Runtime

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05  # how often a draining generation looks at its requests in flight


@dataclass(eq=False)
class Generation:
    number: int  # 1, 2, ... across the server's life: the log and the index name it
    models: frozenset[str]  # every model of the group (its runtime serves each)
    stages: frozenset[str]
    plan: Plan  # compiler.partition.subplan of the repository's plan
    fingerprint: str  # compiler.partition.fingerprint of its stage folders
    runtime: Runtime
    started_s: float = field(default_factory=time.monotonic)

    def same_as(self, plan: Plan, fingerprint: str) -> bool:
        """True when `plan` (a subplan of a newer compile) would run exactly this generation."""
        return self.fingerprint == fingerprint and self.plan == plan

    @property
    def age_s(self) -> float:
        """Seconds since this generation was made (at its start, how long the start took)."""
        return time.monotonic() - self.started_s

    @property
    def in_flight(self) -> int:
        """Requests submitted to this generation that have not ended."""
        return self.runtime.coordinator.in_flight

    async def start(self) -> None:
        """Start every process; raises PipelineError (and leaves nothing running) on failure."""
        await self.runtime.start()

    async def drain(self, timeout_s: float, *, on_stopped: Callable[[], None] | None = None) -> int:
        """Let the requests in flight finish (up to `timeout_s`), then stop the processes.
        Returns how many requests were still running at the deadline (they fail as
        unavailable). The caller routes no new request here any more."""
        deadline = time.monotonic() + timeout_s
        # a poll, not an event: the coordinator has no hook for "last flight retired", and a
        # drain is rare and may take as long as a stream
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        left = self.in_flight
        if left:
            log.warning(
                "generation %d: %d request(s) still running after the %g s drain; stopping",
                self.number,
                left,
                timeout_s,
            )
        await self.runtime.stop()
        log.info("generation %d (%s) stopped", self.number, ", ".join(sorted(self.models)))
        if on_stopped is not None:
            on_stopped()
        return left


@dataclass(frozen=True)
class ServedPlan(Plan):
    """The plan the serving layer reads under model control: the served models, and beside
    them the models being loaded now (not served yet), so that a request naming one is told
    to come back (503 with Retry-After) rather than that it does not exist (404)."""

    loading: Mapping[str, ModelSpec] = EMPTY

    def loading_model(self, name: str) -> ModelSpec | None:
        """The model being loaded that is called `name` (its id or an alias), or None."""
        for spec in self.loading.values():
            if name == spec.id or name in spec.aliases:
                return spec
        return None


def served_plan(
    repository: Path,
    serving: Mapping[str, Generation],
    loading: Mapping[str, ModelSpec] | None = None,
) -> ServedPlan:
    """One read-only plan of the served models (what /v1/models, the endpoints and the
    OpenAPI document read): each served model with its generation's stages and processes,
    and `loading`: models not served yet whose load is under way."""
    stages: dict[str, Any] = {}
    processes: dict[str, Any] = {}
    models: dict[str, ModelSpec] = {}
    instances: list[Any] = []
    edges: list[Any] = []
    server = None
    for gen in dict.fromkeys(serving.values()):
        stages.update(gen.plan.stages)
        processes.update(gen.plan.processes)
        instances.extend(gen.plan.instances)
        edges.extend(gen.plan.edges)
        server = server or gen.plan.server
    for model, gen in serving.items():
        models[model] = gen.plan.models[model]
    return ServedPlan(
        repository=repository,
        server=server or ServerOptions(),
        stages=FrozenMap(stages),
        models=FrozenMap(models),
        processes=FrozenMap(processes),
        instances=tuple(instances),
        edges=tuple(edges),
        loading=FrozenMap({m: spec for m, spec in (loading or {}).items() if m not in models}),
    )


async def cleaned_up(drains: list[asyncio.Task[int]]) -> None:
    """Until every drain of `drains` has ended: its generation's processes exited and its run
    directory and segments removed. `asyncio.wait`, not `gather`: a control call cancelled
    (by `stop()`) must not cancel a drain half way through stopping processes; `stop()` waits
    for the drains itself."""
    if drains:
        await asyncio.wait(drains)


def config_overrides(config: Mapping[str, Any]) -> tuple[str, ...]:
    """A load's `config` ({"stages.acoustic.parameters.length_scale": 1.2}) as the command
    line's dotted overrides; strings as written, other JSON values as JSON (the override
    parser reads lists, numbers and booleans in that form)."""
    out = []
    for path, value in config.items():
        text = value if isinstance(value, str) else json.dumps(value)
        out.append(f"--{path}={text}")
    return tuple(out)
