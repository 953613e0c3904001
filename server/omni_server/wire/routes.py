"""Questions about a plan that the runtime asks: who hosts a stage, who feeds whom, what a model
can reach. Pure functions of the plan and a request's replica binding."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from omni_server.compiler.plan import EdgeKind, ModelSpec, Plan, ProcessInstance


@dataclass(frozen=True)
class Routes:
    plan: Plan

    @cached_property
    def index(self) -> dict[tuple[str, int, int], int]:
        """(process, replica, tp_rank) -> instance index in plan.instances."""
        return {(i.process, i.replica, i.tp_rank): n for n, i in enumerate(self.plan.instances)}

    def host_of(self, stage: str, bindings: Mapping[str, int]) -> int:
        """Index of the instance (TP rank 0) hosting `stage` for a request with `bindings`."""
        process = self.plan.stages[stage].process
        return self.index[(process, bindings.get(process, 0), 0)]

    @cached_property
    def next_preds(self) -> dict[str, tuple[str, ...]]:
        """stage -> stages handing it a payload (next / route edges)."""
        return self._preds(EdgeKind.NEXT)

    @cached_property
    def stream_preds(self) -> dict[str, tuple[str, ...]]:
        """stage -> stages streaming chunks into it (stream_to edges)."""
        return self._preds(EdgeKind.STREAM)

    def _preds(self, kind: EdgeKind) -> dict[str, tuple[str, ...]]:
        preds: dict[str, list[str]] = {s: [] for s in self.plan.stages}
        for spec in self.plan.stages.values():
            for dst in spec.next if kind is EdgeKind.NEXT else spec.stream_to:
                preds[dst].append(spec.name)
        return {s: tuple(p) for s, p in preds.items()}

    @cached_property
    def model_stages(self) -> dict[str, frozenset[str]]:
        """model id -> the stages its requests visit (the compiler resolved them)."""
        every = frozenset(self.plan.stages)  # a plan built by hand may leave stages empty
        return {m.id: frozenset(m.stages) or every for m in self.plan.models.values()}

    def visits(self, model: str) -> frozenset[str]:
        """The stages a request of `model` visits ("" = every stage: tests and tools)."""
        return self.model_stages[model] if model else frozenset(self.plan.stages)

    def terminals(self, model: str) -> set[str]:
        return {s for s in self.visits(model) if self.plan.stages[s].terminal}

    def reached(self, stages: tuple[str, ...], model: str) -> frozenset[str]:
        """The stages among `stages` that a request of `model` visits."""
        return frozenset(stages) & self.visits(model)

    @cached_property
    def model_processes(self) -> dict[str, tuple[str, ...]]:
        """model id -> the logical processes its requests can touch."""
        return {
            model: tuple(sorted({self.plan.stages[s].process for s in stages}))
            for model, stages in self.model_stages.items()
        }

    def touched(self, model: ModelSpec, bindings: Mapping[str, int]) -> tuple[int, ...]:
        """Every instance (all TP ranks) a request of `model` with `bindings` may reach."""
        out: list[int] = []
        for process in self.model_processes[model.id]:
            replica = bindings.get(process, 0)
            tp = self.plan.processes[process].tp_size
            out.extend(self.index[(process, replica, rank)] for rank in range(tp))
        return tuple(out)

    def senders_to(self, n: int) -> set[int]:
        """Instances that may send data (payloads, chunks) to instance `n` (TP rank 0 only)."""
        target: ProcessInstance = self.plan.instances[n]
        if target.tp_rank != 0:
            return set()
        out = set()
        for m, inst in enumerate(self.plan.instances):
            if inst.process == target.process or inst.tp_rank != 0:
                continue
            for stage in inst.stages:
                spec = self.plan.stages[stage]
                successors = (*spec.next, *spec.stream_to)
                if any(self.plan.stages[d].process == target.process for d in successors):
                    out.add(m)
        return out

    def takes_entries(self, n: int) -> bool:
        """Instance `n` hosts the entry stage of some model: the coordinator sends it payloads."""
        inst = self.plan.instances[n]
        return inst.tp_rank == 0 and any(m.entry in inst.stages for m in self.plan.models.values())
