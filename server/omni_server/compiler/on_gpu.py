"""[on_gpu] tables: what a stage, or the repository, changes where it runs on a GPU.

A stage's `[on_gpu]` holds stage fields (`schema.ON_GPU_STAGE_FIELDS`: its memory budget, the
engine's dtype, its process, ...) that replace the file's where the stage lands on a GPU.
repository.toml's `[on_gpu]` holds `[on_gpu.server]` and `[on_gpu.processes.<name>]` (MPS,
replicas, their devices), applied where any stage lands on a GPU. The layers, lowest first:
the files, their [on_gpu] where it applies, the command line's overrides. Tables merge key by
key: `[on_gpu.engine] dtype = "bfloat16"` changes the dtype and keeps the other engine fields.

Every [on_gpu] is checked on every machine, applied or not, so a mistake in one shows on the
CPU machine it was written on.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.files import RawRepository, RawStage
from omni_server.compiler.schema import (
    ON_GPU_REPOSITORY_TABLES,
    ON_GPU_STAGE_FIELDS,
    PROCESS_FIELDS,
    SERVER_FIELDS,
    STAGE_TABLES,
    check_fields,
)

TABLE = "on_gpu"


def check(raw: RawRepository) -> None:
    """Every [on_gpu] of the repository well formed: known fields of the right types."""
    for rs in raw.stages.values():
        table = rs.data.get(TABLE)
        if table is None:
            continue
        check_fields(table, ON_GPU_STAGE_FIELDS, file=rs.file, stage=rs.name, prefix="on_gpu.")
        for name, fields in STAGE_TABLES.items():
            if name in table:
                prefix = f"on_gpu.{name}."
                check_fields(table[name], fields, file=rs.file, stage=rs.name, prefix=prefix)
    table = raw.data.get(TABLE)
    if table is None:
        return
    if not isinstance(table, dict):
        raise RepositoryError(
            f"expected a table ([{TABLE}]), got {type(table).__name__}", file=raw.file, field=TABLE
        )
    for key in table:
        if key not in ON_GPU_REPOSITORY_TABLES:
            raise RepositoryError(
                f"unknown table; [on_gpu] holds {', '.join(ON_GPU_REPOSITORY_TABLES)}",
                file=raw.file,
                field=f"on_gpu.{key}",
            )
    check_fields(table.get("server", {}), SERVER_FIELDS, file=raw.file, prefix="on_gpu.server.")
    processes = table.get("processes", {})
    if not isinstance(processes, dict):
        raise RepositoryError(
            f"expected a table, got {type(processes).__name__}",
            file=raw.file,
            field="on_gpu.processes",
        )
    for name, data in processes.items():
        prefix = f"on_gpu.processes.{name}."
        check_fields(data, PROCESS_FIELDS, file=raw.file, prefix=prefix)


def apply(raw: RawRepository, on_gpu: Collection[str]) -> dict[str, str]:
    """Merge the [on_gpu] of the stages in `on_gpu` (those landing on a GPU) into their
    tables, and the repository's when any does. Returns each path set (as an override path:
    `stages.tts_engine.engine.dtype`, `server.mps`) -> the file that set it."""
    applied: dict[str, str] = {}
    for name in on_gpu:
        rs: RawStage = raw.stages[name]
        for path in _merge(rs.data, rs.data.get(TABLE, {}), ""):
            applied[f"stages.{name}.{path}"] = str(rs.file)
    if on_gpu:
        table = raw.data.get(TABLE, {})
        for path in _merge(raw.data, table, ""):
            applied[path] = str(raw.file)
    return applied


def _merge(into: dict[str, Any], table: Mapping[str, Any], prefix: str) -> list[str]:
    """Set `table`'s values in `into`, tables merged key by key; the dotted paths set."""
    paths = []
    for key, value in table.items():
        current = into.get(key)
        if isinstance(value, Mapping) and isinstance(current, dict):
            paths += _merge(current, value, f"{prefix}{key}.")
        else:
            into[key] = _copy(value)
            paths.append(f"{prefix}{key}")
    return paths


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value
