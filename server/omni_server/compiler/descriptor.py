"""One `stage.toml` -> a `StageSpec`: its fields typed and the rules that need no other stage.

Rules across stages (targets exist, fan-in, cycles) live in `graph`; the stage's device in
`devices`; processes, replicas and memory in `placement`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from omni_server.compiler import devices
from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.files import NAME, RawStage
from omni_server.compiler.plan import (
    NO_GPU,
    BackendRef,
    EngineSpec,
    FrozenMap,
    MachineFacts,
    SamplingSpec,
    SchedulerKind,
    SchedulerSpec,
    StageSpec,
)
from omni_server.compiler.schema import (
    ENGINE_FIELDS,
    SAMPLING_FIELDS,
    SCHEDULER_FIELDS,
    STAGE_FIELDS,
    STAGE_TABLES,
    Kind,
    check_fields,
    field_value,
)
from omni_server.engine_config import EngineConfigError, check_table

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


class _Fail:
    """Errors about one stage descriptor: file and stage named, the field given per error."""

    def __init__(self, rs: RawStage) -> None:
        self.rs = rs

    def __call__(self, field: str, message: str) -> RepositoryError:
        return RepositoryError(message, file=self.rs.file, stage=self.rs.name, field=field)

    def unique(self, values: tuple[Any, ...], field: str) -> None:
        check_unique(values, file=self.rs.file, stage=self.rs.name, field=field)


def parse_stage(
    rs: RawStage, machine: MachineFacts = NO_GPU, on_gpu_applied: bool = False
) -> StageSpec:
    """Type-check one stage descriptor (its [on_gpu] already applied where it lands on a GPU)
    and apply the per-stage rules; `machine` resolves its `device`."""
    data = check_fields(rs.data, STAGE_FIELDS, file=rs.file, stage=rs.name)
    for table, fields in STAGE_TABLES.items():
        if table in data:
            check_fields(data[table], fields, file=rs.file, stage=rs.name, prefix=f"{table}.")
    fail = _Fail(rs)
    process = data.get("process", rs.name)  # the default is the stage's own name
    if not NAME.match(process):
        raise fail("process", "a process name may hold only letters, digits, '_' and '-'")
    device = devices.choose(data, machine, fail)
    tp_size = device.tp_size
    scheduler = _scheduler(data.get("scheduler", {}), fail)
    if scheduler.first_chunk_lane and tp_size > 1:  # TP ranks mirror one call at a time
        raise fail("scheduler.first_chunk_lane", f"not with tp_size = {tp_size}")
    nxt, route, terminal, stream_to = _routing(data, scheduler, fail)
    wait_for, merge = _fan_in(data, fail)
    process_local = _names(_value(data, "process_local"))
    for target in process_local:
        if target not in nxt and target not in stream_to:
            raise fail(
                "process_local",
                f"'{target}' is not a successor of this stage; successors: "
                f"{list(dict.fromkeys((*nxt, *stream_to)))}",
            )
    return StageSpec(
        name=rs.name,
        directory=rs.directory,
        backend=_backend(rs, fail),
        parameters=freeze(_value(data, "parameters")),
        process=process,
        gpu=device.gpu,
        tp_size=tp_size,
        gpu_memory_fraction=device.gpu_memory_fraction,
        next=nxt,
        route=route,
        terminal=terminal,
        wait_for=wait_for,
        merge=merge,
        stream_to=stream_to,
        process_local=process_local,
        scheduler=scheduler,
        engine=_engine(data, fail),
        timeout_s=float(data["timeout_s"]) if "timeout_s" in data else None,
        sampling=_sampling(data.get("sampling", {})),
        voice_cloning=bool(_value(data, "voice_cloning")),
        device=device.request,
        on_gpu_applied=on_gpu_applied,
    )


def _value(data: dict[str, Any], name: str) -> Any:
    return field_value(data, STAGE_FIELDS, name)


def _routing(
    data: dict[str, Any], scheduler: SchedulerSpec, fail: _Fail
) -> tuple[tuple[str, ...], str | None, bool, tuple[str, ...]]:
    """Where a stage's output goes: `next` (static, or chosen by `route`), `stream_to`
    (chunks), or nowhere because it is terminal. A stage may have stream successors only."""
    nxt = _names(_value(data, "next"))
    route = data.get("route")
    terminal: bool = _value(data, "terminal")
    stream_to = _names(_value(data, "stream_to"))
    fail.unique(nxt, "next")
    fail.unique(stream_to, "stream_to")
    if terminal and nxt:
        raise fail("terminal", "a terminal stage has no next; give terminal = true or next")
    if route is not None and not nxt:
        raise fail("route", "a route method chooses among next; declare next = [...] too")
    if not terminal and not nxt and not stream_to:
        raise fail(
            "next",
            "no routing: give next = [...], next with route, stream_to = [...], or terminal = true",
        )
    if route is not None and not IDENTIFIER.match(route):
        raise fail("route", f"'{route}' is not a method name of the backend class")
    if stream_to and scheduler.kind not in (SchedulerKind.STREAM, SchedulerKind.AR):
        raise fail(
            "stream_to",
            'only a stream or ar stage yields chunks: set [scheduler] kind = "stream" '
            f'(it is "{scheduler.kind}")',
        )
    return nxt, route, terminal, stream_to


def _fan_in(data: dict[str, Any], fail: _Fail) -> tuple[tuple[str, ...], str | None]:
    wait_for = tuple(_value(data, "wait_for"))
    merge = data.get("merge")
    if wait_for and merge is None:
        raise fail("merge", 'wait_for needs merge = "<backend method>" combining the inputs')
    if merge is not None and not wait_for:
        raise fail("merge", "merge combines the wait_for inputs; declare wait_for = [...]")
    if merge is not None and not IDENTIFIER.match(merge):
        raise fail("merge", f"'{merge}' is not a method name of the backend class")
    fail.unique(wait_for, "wait_for")
    return wait_for, merge


def _engine(data: dict[str, Any], fail: _Fail) -> EngineSpec | None:
    if "engine" not in data:
        return None
    table = data["engine"]
    try:  # each field is checked already; here the rules across fields, EngineConfig's own
        check_table(table)
    except EngineConfigError as err:
        raise fail(f"engine.{err.field}", err.problem) from None
    return EngineSpec(
        max_total_tokens=field_value(table, ENGINE_FIELDS, "max_total_tokens"),
        settings=freeze(table),
    )


def _sampling(table: dict[str, Any]) -> SamplingSpec:
    """[sampling], typed by check_fields: numbers as floats (TOML's `1` is an int)."""
    floats = {k: float(v) for k, v in table.items() if SAMPLING_FIELDS[k].kind is Kind.FLOAT}
    return SamplingSpec(**{**table, **floats})


def _backend(rs: RawStage, fail: _Fail) -> BackendRef:
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


def _scheduler(data: dict[str, Any], fail: _Fail) -> SchedulerSpec:
    kind = SchedulerKind(field_value(data, SCHEDULER_FIELDS, "kind"))
    size: int = field_value(data, SCHEDULER_FIELDS, "max_batch_size")
    delay = float(field_value(data, SCHEDULER_FIELDS, "max_queue_delay_ms"))
    if kind is not SchedulerKind.BATCH:
        if size != 1:
            raise fail("scheduler.max_batch_size", f'batches need kind = "batch" (it is "{kind}")')
        if delay != 0.0:
            raise fail(
                "scheduler.max_queue_delay_ms", f'batches need kind = "batch" (it is "{kind}")'
            )
    lane: bool = field_value(data, SCHEDULER_FIELDS, "first_chunk_lane")
    if lane and kind is not SchedulerKind.STREAM:
        raise fail(
            "scheduler.first_chunk_lane",
            f'a first-chunk lane needs kind = "stream" (it is "{kind}")',
        )
    return SchedulerSpec(
        kind=kind, max_batch_size=size, max_queue_delay_ms=delay, first_chunk_lane=lane
    )


def freeze(value: Any) -> Any:
    """TOML tables -> FrozenMap, arrays -> tuples: a plan's parameters are read-only."""
    if isinstance(value, dict):
        return FrozenMap({k: freeze(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(freeze(v) for v in value)
    return value
