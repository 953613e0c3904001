"""Repository folder (+ overrides) -> a validated, immutable `Plan`.

Passes, each in its own module: read (`loader`), override (`overrides`), fields (`descriptor`
for each stage.toml, this module for repository.toml), wiring (`graph`: the stage DAG across
stages), placement (`placement`: processes, replicas, devices, memory). Any broken rule raises
RepositoryError naming the file, stage and field; nothing is started and nothing is written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from omni_server.compiler import graph, placement
from omni_server.compiler.descriptor import check_unique, freeze, parse_stage
from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.files import RawRepository, load_repository
from omni_server.compiler.overrides import apply_overrides
from omni_server.compiler.plan import (
    FrozenMap,
    ModelSpec,
    MpsMode,
    Plan,
    ServerOptions,
    StageSpec,
)
from omni_server.compiler.schema import (
    MODEL_FIELDS,
    REPOSITORY_TABLES,
    SERVER_FIELDS,
    TASKS,
    check_fields,
    field_value,
)


def compile_repository(path: str | Path, overrides: Sequence[str] = ()) -> Plan:
    """Read, override, validate and compile the repository at `path` into a Plan."""
    raw = load_repository(path)
    overridden = apply_overrides(raw, overrides)
    try:
        return _compile(raw)
    except RepositoryError as e:
        raise _blame_override(e, overridden) from None


def _blame_override(error: RepositoryError, overridden: Mapping[str, str]) -> RepositoryError:
    """Say so when the value breaking a rule came from the command line, not the file."""
    if not overridden:
        return error
    key = f"stages.{error.stage}.{error.field}" if error.stage is not None else error.field
    if key is None or error.field is None or key not in overridden:
        # a rule across fields (a process two stages share, a GPU budget): the file alone may
        # be fine, so name every override that changed the repository
        applied = ", ".join(f"--{path}" for path in overridden.values())
        reason = f"{error.reason} (with the command-line overrides {applied})"
        return RepositoryError(reason, file=error.file, stage=error.stage, field=error.field)
    return RepositoryError(
        f"{error.reason} (the value comes from --{overridden[key]})",
        file=error.file,
        stage=error.stage,
        field=error.field,
    )


def _compile(raw: RawRepository) -> Plan:
    _check_repository_tables(raw)
    server = _server(raw)
    stages = {name: parse_stage(rs) for name, rs in raw.stages.items()}
    files = {name: rs.file for name, rs in raw.stages.items()}
    models = _models(raw, stages)
    order = graph.check_wiring(stages, models, files, raw.file)
    stages = {name: stages[name] for name in order}  # pipeline order: upstream first
    models = {
        model_id: replace(model, stages=tuple(s for s in order if s in visited))
        for model_id, model in models.items()
        for visited in [graph.model_stages(model, stages, raw.file)]
    }
    processes = placement.build_processes(stages, _table(raw, "processes"), files, raw.file)
    edges = graph.edges(stages)
    placement.check_process_local(edges, stages, processes, files)
    instances = placement.build_instances(processes, stages)
    placement.check_memory(instances, stages, processes, server, files, raw.file)
    placement.check_weight_share(instances, stages, processes, server, files, raw.file)
    return Plan(
        repository=raw.root,
        server=server,
        parameters=freeze(_table(raw, "parameters")),
        stages=FrozenMap(stages),
        models=FrozenMap(models),
        processes=FrozenMap(processes),
        instances=instances,
        edges=edges,
    )


# ---- helpers ------------------------------------------------------------------------------


def _table(raw: RawRepository, key: str) -> dict[str, Any]:
    return raw.data.get(key, {})


# ---- repository.toml ----------------------------------------------------------------------


def _check_repository_tables(raw: RawRepository) -> None:
    for key, value in raw.data.items():
        if key not in REPOSITORY_TABLES:
            raise RepositoryError(
                f"unknown table; valid tables: {', '.join(REPOSITORY_TABLES)}",
                file=raw.file,
                field=key,
            )
        if not isinstance(value, dict):
            raise RepositoryError(
                f"expected a table ([{key}]), got {type(value).__name__}", file=raw.file, field=key
            )


def _server(raw: RawRepository) -> ServerOptions:
    data = check_fields(_table(raw, "server"), SERVER_FIELDS, file=raw.file, prefix="server.")
    return ServerOptions(
        mps=MpsMode(field_value(data, SERVER_FIELDS, "mps")),
        weight_share=field_value(data, SERVER_FIELDS, "weight_share") == "on",
        gpu_memory_limit=float(field_value(data, SERVER_FIELDS, "gpu_memory_limit")),
        stage_timeout_s=float(field_value(data, SERVER_FIELDS, "stage_timeout_s")),
    )


def _models(raw: RawRepository, stages: Mapping[str, StageSpec]) -> dict[str, ModelSpec]:
    table = _table(raw, "models")
    if not table:
        raise RepositoryError(
            "no served model: declare at least one [models.<id>] with entry and tasks",
            file=raw.file,
            field="models",
        )
    models: dict[str, ModelSpec] = {}
    taken: dict[str, str] = {}  # every id and alias -> the model owning it
    for model_id, data in table.items():
        prefix = f"models.{model_id}."
        check_fields(data, MODEL_FIELDS, file=raw.file, prefix=prefix)
        for required in ("entry", "tasks"):
            if required not in data:
                raise RepositoryError(
                    f"required; {MODEL_FIELDS[required].doc}",
                    file=raw.file,
                    field=prefix + required,
                )
        entry = data["entry"]
        if entry not in stages:
            raise RepositoryError(
                f"no stage '{entry}'; stages: {', '.join(stages)}",
                file=raw.file,
                field=prefix + "entry",
            )
        tasks = tuple(data["tasks"])
        if not tasks or any(t not in TASKS for t in tasks):
            raise RepositoryError(
                f"expected a non-empty list of {', '.join(TASKS)}; got {list(tasks)}",
                file=raw.file,
                field=prefix + "tasks",
            )
        check_unique(tasks, file=raw.file, stage=None, field=prefix + "tasks")
        aliases = tuple(field_value(data, MODEL_FIELDS, "aliases"))
        for name, field in [(model_id, "models"), *((a, prefix + "aliases") for a in aliases)]:
            if name in taken:
                raise RepositoryError(
                    f"'{name}' already names model '{taken[name]}'", file=raw.file, field=field
                )
            taken[name] = model_id
        voices = tuple(field_value(data, MODEL_FIELDS, "voices"))
        check_unique(voices, file=raw.file, stage=None, field=prefix + "voices")
        default_voice = data.get("default_voice")
        if default_voice is not None and default_voice not in voices:
            raise RepositoryError(
                f"'{default_voice}' is not among voices {list(voices)}",
                file=raw.file,
                field=prefix + "default_voice",
            )
        voice_aliases = field_value(data, MODEL_FIELDS, "voice_aliases")
        for alias, voice in voice_aliases.items():
            if voice not in voices:
                raise RepositoryError(
                    f"alias '{alias}' names '{voice}', which is not among voices {list(voices)}",
                    file=raw.file,
                    field=f"{prefix}voice_aliases.{alias}",
                )
            if alias in voices:
                raise RepositoryError(
                    f"alias '{alias}' would hide the voice of that name",
                    file=raw.file,
                    field=f"{prefix}voice_aliases.{alias}",
                )
        models[model_id] = ModelSpec(
            id=model_id,
            entry=entry,
            tasks=tasks,
            stages=tuple(field_value(data, MODEL_FIELDS, "stages")),
            aliases=aliases,
            voices=voices,
            voice_aliases=FrozenMap(voice_aliases),
            default_voice=default_voice,
            description=field_value(data, MODEL_FIELDS, "description"),
            language=data.get("language"),
            sampling=stages[entry].sampling,
        )
    return models
