"""One `stage.toml` -> a `StageSpec`: its fields typed and the rules that need no other stage.

Rules across stages (targets exist, fan-in, cycles) live in `graph`; processes, devices and
memory in `placement`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omni_server.repository.errors import RepositoryError
from omni_server.repository.files import NAME, RawStage
from omni_server.repository.plan import (
    BackendRef,
    EngineSpec,
    FrozenMap,
    SchedulerKind,
    SchedulerSpec,
    StageSpec,
)
from omni_server.repository.schema import STAGE_FIELDS, STAGE_TABLES, check_fields

DEFAULT_BACKEND_FILE = "model.py"
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _names(value: str | list[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def check_unique(values: tuple[Any, ...], *, file: Path, stage: str | None, field: str) -> None:
    seen = set()
    for v in values:
        if v in seen:
            raise RepositoryError(f"'{v}' is listed twice", file=file, stage=stage, field=field)
        seen.add(v)


def parse_stage(rs: RawStage) -> StageSpec:
    """Type-check one stage descriptor and apply the per-stage rules."""
    data = check_fields(rs.data, STAGE_FIELDS, file=rs.file, stage=rs.name)
    for table, fields in STAGE_TABLES.items():
        if table in data:
            check_fields(data[table], fields, file=rs.file, stage=rs.name, prefix=f"{table}.")

    def fail(field: str, message: str) -> RepositoryError:
        return RepositoryError(message, file=rs.file, stage=rs.name, field=field)

    backend = _backend(rs, fail)
    process = data.get("process", rs.name)
    if not NAME.match(process):
        raise fail("process", "a process name may hold only letters, digits, '_' and '-'")

    # Placement: a GPU id per TP rank.
    gpu = _names_or_ints(data.get("gpu"))
    if "gpu" in data and not gpu:
        raise fail("gpu", "gpu = [] names no GPU; drop the field for a CPU stage")
    # Without `gpu` a TP stage runs its ranks on the CPU (torch.distributed over gloo).
    tp_size = data.get("tp_size", 1)
    if gpu and len(gpu) != tp_size:
        raise fail(
            "gpu",
            f"{len(gpu)} GPU ids for tp_size = {tp_size}; give exactly one id per TP rank",
        )
    if len(set(gpu)) != len(gpu):
        raise fail("gpu", f"TP ranks may not share a GPU: {list(gpu)}")
    fraction = data.get("gpu_memory_fraction")
    if fraction is not None and not gpu:
        raise fail("gpu_memory_fraction", "a CPU stage budgets no GPU memory; set gpu or drop it")

    # Routing: exactly one of `next`, `next` + `route`, `terminal = true`.
    nxt = _names(data.get("next", []))
    route = data.get("route")
    terminal = data.get("terminal", False)
    if terminal and nxt:
        raise fail("terminal", "a terminal stage has no next; give terminal = true or next")
    if route is not None and not nxt:
        raise fail("route", "a route method chooses among next; declare next = [...] too")
    if not terminal and not nxt:
        raise fail("next", "no routing: give next = [...], next with route, or terminal = true")
    if route is not None and not IDENTIFIER.match(route):
        raise fail("route", f"'{route}' is not a method name of the backend class")
    check_unique(nxt, file=rs.file, stage=rs.name, field="next")

    wait_for = tuple(data.get("wait_for", []))
    merge = data.get("merge")
    if wait_for and merge is None:
        raise fail("merge", 'wait_for needs merge = "<backend method>" combining the inputs')
    if merge is not None and not wait_for:
        raise fail("merge", "merge combines the wait_for inputs; declare wait_for = [...]")
    if merge is not None and not IDENTIFIER.match(merge):
        raise fail("merge", f"'{merge}' is not a method name of the backend class")
    check_unique(wait_for, file=rs.file, stage=rs.name, field="wait_for")

    scheduler = _scheduler(data.get("scheduler", {}), fail)
    stream_to = _names(data.get("stream_to", []))
    check_unique(stream_to, file=rs.file, stage=rs.name, field="stream_to")
    if stream_to and scheduler.kind is not SchedulerKind.STREAM:
        raise fail(
            "stream_to",
            'only a stream stage yields chunks: set [scheduler] kind = "stream" '
            f'(it is "{scheduler.kind}")',
        )
    process_local = _names(data.get("process_local", []))
    for target in process_local:
        if target not in nxt and target not in stream_to:
            raise fail(
                "process_local",
                f"'{target}' is not a successor of this stage; successors: "
                f"{list(dict.fromkeys((*nxt, *stream_to)))}",
            )

    engine = None
    if "engine" in data:
        engine = EngineSpec(max_total_tokens=data["engine"].get("max_total_tokens"))
    return StageSpec(
        name=rs.name,
        directory=rs.directory,
        backend=backend,
        parameters=_freeze(data.get("parameters", {})),
        process=process,
        gpu=gpu,
        tp_size=tp_size,
        gpu_memory_fraction=float(fraction) if fraction is not None else None,
        next=nxt,
        route=route,
        terminal=terminal,
        wait_for=wait_for,
        merge=merge,
        stream_to=stream_to,
        process_local=process_local,
        scheduler=scheduler,
        engine=engine,
    )


def _backend(rs: RawStage, fail: Any) -> BackendRef:
    if "backend" not in rs.data:
        raise fail("backend", 'required: backend = "model.py:ClassName" (or "ClassName")')
    spec: str = rs.data["backend"]
    file_name, sep, class_name = spec.rpartition(":")
    if not sep:
        file_name = DEFAULT_BACKEND_FILE
    if not IDENTIFIER.match(class_name) or not file_name.endswith(".py"):
        raise fail("backend", f'expected "file.py:ClassName" or "ClassName", got "{spec}"')
    file = (rs.directory / file_name).resolve()
    if not file.is_relative_to(rs.directory):
        raise fail("backend", f"'{file_name}' lies outside the stage folder")
    if not file.is_file():
        raise fail("backend", f"no file '{file_name}' in the stage folder")
    return BackendRef(file=file, class_name=class_name)


def _scheduler(data: dict[str, Any], fail: Any) -> SchedulerSpec:
    kind = SchedulerKind(data.get("kind", "single"))
    size = data.get("max_batch_size", 1)
    delay = float(data.get("max_queue_delay_ms", 0.0))
    if kind is not SchedulerKind.BATCH:
        if size != 1:
            raise fail("scheduler.max_batch_size", f'batches need kind = "batch" (it is "{kind}")')
        if delay != 0.0:
            raise fail(
                "scheduler.max_queue_delay_ms", f'batches need kind = "batch" (it is "{kind}")'
            )
    return SchedulerSpec(kind=kind, max_batch_size=size, max_queue_delay_ms=delay)


def _names_or_ints(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


def _freeze(value: Any) -> Any:
    """TOML tables -> FrozenMap, arrays -> tuples: a plan's parameters are read-only."""
    if isinstance(value, dict):
        return FrozenMap({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value
