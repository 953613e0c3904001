"""Wiring rules across stages: targets exist, fan-in is consistent, the graph is a DAG that
every served model's entry reaches in full.

A model may name the `stages` its requests visit (models then share stages: a chat model that
ends at the thinker, an omni model that goes on to the voice); `model_stages` checks that such a
subgraph is closed: every non-terminal stage in it hands data on to a stage in it.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from pathlib import Path

from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.plan import Edge, EdgeKind, ModelSpec, StageSpec


def check_wiring(
    stages: Mapping[str, StageSpec],
    models: Mapping[str, ModelSpec],
    files: Mapping[str, Path],
    repository_file: Path,
) -> list[str]:
    """Raise on a broken wiring rule; return the stage names in pipeline (topological) order."""
    for spec in stages.values():
        for field, targets in (
            ("next", spec.next),
            ("stream_to", spec.stream_to),
            ("wait_for", spec.wait_for),
        ):
            for target in targets:
                if target not in stages:
                    raise RepositoryError(
                        f"no stage '{target}'; stages: {', '.join(stages)}",
                        file=files[spec.name],
                        stage=spec.name,
                        field=field,
                    )
                if target == spec.name:
                    raise RepositoryError(
                        "a stage cannot name itself (the pipeline is a DAG)",
                        file=files[spec.name],
                        stage=spec.name,
                        field=field,
                    )
                if field == "stream_to" and stages[target].tp_size > 1:
                    # Only TP rank 0 hears from other stages; its peers would never see the
                    # chunks, so their collective calls would fall out of step.
                    raise RepositoryError(
                        f"stream target '{target}' is tensor-parallel (tp_size "
                        f"{stages[target].tp_size}); chunks reach only its rank 0, so a TP stage "
                        "cannot take a stream: hand it the full payload with `next` instead",
                        file=files[spec.name],
                        stage=spec.name,
                        field=field,
                    )
    _check_fan_in(stages, files)
    order = _topological_order(stages, files)
    _check_models(stages, models, files, repository_file)
    return order


def successors(spec: StageSpec) -> tuple[str, ...]:
    """Every stage this one hands data to (`next` and `stream_to`), without repeats."""
    return tuple(dict.fromkeys((*spec.next, *spec.stream_to)))


def edges(stages: Mapping[str, StageSpec]) -> tuple[Edge, ...]:
    out = []
    for spec in stages.values():
        for dst in spec.next:
            out.append(Edge(spec.name, dst, EdgeKind.NEXT, dst in spec.process_local))
        for dst in spec.stream_to:
            out.append(Edge(spec.name, dst, EdgeKind.STREAM, dst in spec.process_local))
    return tuple(out)


def _check_fan_in(stages: Mapping[str, StageSpec], files: Mapping[str, Path]) -> None:
    for spec in stages.values():
        for upstream in spec.wait_for:
            if spec.name not in stages[upstream].next:
                raise RepositoryError(
                    f"'{upstream}' never hands data to '{spec.name}': add '{spec.name}' to the "
                    f"next of '{upstream}' (its next = {list(stages[upstream].next)})",
                    file=files[spec.name],
                    stage=spec.name,
                    field="wait_for",
                )
    # A fan-in stage merges exactly what it waits for: any other sender would be ambiguous.
    for spec in stages.values():
        for dst in spec.next:
            target = stages[dst]
            if target.wait_for and spec.name not in target.wait_for:
                raise RepositoryError(
                    f"'{dst}' waits for {list(target.wait_for)} only: add '{spec.name}' to its "
                    "wait_for or drop it from next",
                    file=files[spec.name],
                    stage=spec.name,
                    field="next",
                )


def _topological_order(stages: Mapping[str, StageSpec], files: Mapping[str, Path]) -> list[str]:
    """Kahn's algorithm, ties broken by name so the order (and every printout) is stable."""
    indegree = dict.fromkeys(stages, 0)
    for spec in stages.values():
        for dst in successors(spec):
            indegree[dst] += 1
    ready = [name for name, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        name = heapq.heappop(ready)
        order.append(name)
        for dst in successors(stages[name]):
            indegree[dst] -= 1
            if indegree[dst] == 0:
                heapq.heappush(ready, dst)
    if len(order) < len(stages):
        cycle = _find_cycle(stages, [n for n in stages if indegree[n] > 0])
        raise RepositoryError(
            "the stages form a cycle: " + " -> ".join(cycle),
            file=files[cycle[0]],
            stage=cycle[0],
            field="next" if cycle[1] in stages[cycle[0]].next else "stream_to",
        )
    return order


def _find_cycle(stages: Mapping[str, StageSpec], left: list[str]) -> list[str]:
    """A cycle among the stages Kahn's algorithm could not order, as `a -> b -> a`.

    Every such stage has a predecessor that is also left over, so walking predecessors from
    any of them must revisit a stage; the walk, reversed, is a cycle.
    """
    preds = {n: [p for p in left if n in successors(stages[p])] for n in left}
    walk = [min(left)]
    while True:
        prev = min(preds[walk[-1]])
        if prev in walk:
            cycle = [*walk[walk.index(prev) :], prev][::-1]
            # Start the printout at its alphabetically first stage, for a stable message.
            start = cycle.index(min(cycle[:-1]))
            return [*cycle[start:-1], *cycle[:start], cycle[start]]
        walk.append(prev)


def _check_models(
    stages: Mapping[str, StageSpec],
    models: Mapping[str, ModelSpec],
    files: Mapping[str, Path],
    repository_file: Path,
) -> None:
    reached: set[str] = set()
    for model in models.values():
        if stages[model.entry].wait_for:
            raise RepositoryError(
                f"entry '{model.entry}' is a fan-in stage (wait_for); a request enters at one "
                "stage that needs no merge",
                file=repository_file,
                field=f"models.{model.id}.entry",
            )
        reached |= model_stages(model, stages, repository_file)
    for name, spec in stages.items():
        if name not in reached:
            raise RepositoryError(
                "no served model reaches this stage: list it in an upstream stage's next, make "
                f"it a model's entry in {repository_file.name}, or remove the folder",
                file=files[name],
                stage=spec.name,
            )


def model_stages(
    model: ModelSpec, stages: Mapping[str, StageSpec], repository_file: Path
) -> frozenset[str]:
    """The stages a request of `model` visits: those its entry reaches, within the model's
    declared `stages` when it names them. Raises when a declared subgraph is not closed."""
    field = f"models.{model.id}.stages"

    def fail(message: str) -> RepositoryError:
        return RepositoryError(message, file=repository_file, field=field)

    declared = set(model.stages)
    for name in model.stages:
        if name not in stages:
            raise fail(f"no stage '{name}'; stages: {', '.join(stages)}")
    if declared and model.entry not in declared:
        raise fail(f"the entry '{model.entry}' must be among the model's stages")
    inside = (lambda name: name in declared) if declared else (lambda name: True)
    seen = {model.entry}
    todo = [model.entry]
    while todo:
        for dst in successors(stages[todo.pop()]):
            if inside(dst) and dst not in seen:
                seen.add(dst)
                todo.append(dst)
    if declared - seen:
        missing = ", ".join(sorted(declared - seen))
        raise fail(f"the entry '{model.entry}' does not reach {missing} within these stages")
    for name in sorted(seen):
        spec = stages[name]
        if not spec.terminal and not any(inside(dst) for dst in successors(spec)):
            raise fail(
                f"stage '{name}' is not terminal and hands data to no stage of this model "
                f"(its successors: {', '.join(successors(spec))}); add one to stages"
            )
    return frozenset(seen)
