"""A compiled plan cut into the parts that can be loaded, reloaded and unloaded on their own.

Model control (docs/serving.md#model-control) runs one `Runtime` per *group*: the models to
serve that are joined by a stage or a process they share, with every stage those models visit.
A request of a model lives inside one group's runtime, so a group is the unit of a reload: the
thinker shared by the chat, omni and realtime models is one group (restarted once, the three
models follow it); the transcription model, which shares nothing with them, is another one and
is never touched by their reloads.

`subplan` restricts a plan to one group: the same objects the compiler made, minus the stages,
processes, instances, edges and models outside it (an edge to a stage outside is dropped: no
model of the group follows it). `fingerprint` tells a stage folder whose Python changed while
its `stage.toml` did not (the plan holds the backend's path, not its code).

Pure apart from reading the repository's folders (`fingerprint` lists and stats their files).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from omni_server.compiler.plan import FrozenMap, Plan

SKIPPED_DIRS = frozenset({"__pycache__", ".git"})
MAX_FILES = 10_000  # a stage folder with more is fingerprinted by its first 10 000 names


def groups(plan: Plan, models: Iterable[str]) -> list[tuple[frozenset[str], frozenset[str]]]:
    """(model ids, stages) of each group of `models`, in the plan's model order. A model's
    stages are one group; two groups that share a stage or a process are one."""
    wanted = [m for m in plan.models if m in set(models)]
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def join(a: str, b: str) -> None:
        parent[find(a)] = find(b)

    for model_id in wanted:
        stages = _stages_of(plan, model_id)
        join("m:" + model_id, "s:" + stages[0])
        for stage in stages:
            join("s:" + stage, "s:" + stages[0])
            join("s:" + stage, "p:" + plan.stages[stage].process)
    by_root: dict[str, tuple[list[str], set[str]]] = {}
    for model_id in wanted:
        found = by_root.setdefault(find("m:" + model_id), ([], set()))
        found[0].append(model_id)
        found[1].update(_stages_of(plan, model_id))
    return [(frozenset(ms), frozenset(ss)) for ms, ss in by_root.values()]


def _stages_of(plan: Plan, model_id: str) -> tuple[str, ...]:
    return plan.models[model_id].stages or tuple(plan.stages)


def subplan(plan: Plan, models: frozenset[str], stages: frozenset[str]) -> Plan:
    """`plan` restricted to one group (`groups`): its models, stages, their processes and the
    instances of those, the edges between its stages."""
    kept = {}
    for name, spec in plan.stages.items():
        if name not in stages:
            continue
        kept[name] = replace(
            spec,
            next=tuple(s for s in spec.next if s in stages),
            stream_to=tuple(s for s in spec.stream_to if s in stages),
            wait_for=tuple(s for s in spec.wait_for if s in stages),
            process_local=tuple(s for s in spec.process_local if s in stages),
        )
    processes = {
        name: replace(proc, stages=tuple(s for s in proc.stages if s in stages))
        for name, proc in plan.processes.items()
        if any(s in stages for s in proc.stages)
    }
    instances = tuple(
        replace(
            inst,
            stages=tuple(s for s in inst.stages if s in stages),
            devices=FrozenMap({s: d for s, d in inst.devices.items() if s in stages}),
        )
        for inst in plan.instances
        if inst.process in processes
    )
    return Plan(
        repository=plan.repository,
        server=plan.server,
        stages=FrozenMap(kept),
        models=FrozenMap({m: spec for m, spec in plan.models.items() if m in models}),
        processes=FrozenMap(processes),
        instances=instances,
        edges=tuple(e for e in plan.edges if e.src in stages and e.dst in stages),
        parameters=plan.parameters,
        machine=plan.machine,
        on_gpu_applied=plan.on_gpu_applied,
    )


def fingerprint(plan: Plan, stages: Iterable[str]) -> str:
    """A digest of the files in the folders of `stages` (names, sizes, modification times):
    it changes when a stage's code or data is edited."""
    digest = hashlib.sha256()
    for stage in sorted(stages):
        digest.update(f"\0stage {stage}\0".encode())
        for path, size, mtime in _files(plan.stages[stage].directory):
            digest.update(f"{path}\0{size}\0{mtime}\0".encode())
    return digest.hexdigest()


def _files(root: Path) -> list[tuple[str, int, int]]:
    found: list[tuple[str, int, int]] = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        for name in sorted(names):
            path = os.path.join(folder, name)
            try:
                stat = os.stat(path)
            except FileNotFoundError:  # removed while we looked: the next scan sees it
                continue
            found.append((os.path.relpath(path, root), stat.st_size, stat.st_mtime_ns))
            if len(found) >= MAX_FILES:
                return found
    return found
