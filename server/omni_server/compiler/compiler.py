"""Repository folder (+ overrides) -> a validated, immutable `Plan`.

Passes, each in its own module: read (`files`), where each stage lands on this machine
(`devices`, from the files and the command line; then its [on_gpu], `on_gpu`), override
(`overrides`), fields (`descriptor` for each stage.toml, this module for repository.toml),
wiring (`graph`: the stage DAG across stages), placement (`placement`: processes, replicas,
devices, memory). Any broken rule raises
RepositoryError naming the file, stage and field; nothing is started and nothing is written.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from omni_server.compiler import devices, graph, on_gpu, placement
from omni_server.compiler.descriptor import check_unique, freeze, parse_stage
from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.files import RawRepository, RawStage, load_repository
from omni_server.compiler.overrides import apply_overrides
from omni_server.compiler.plan import (
    NO_GPU,
    FrozenMap,
    MachineFacts,
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
    STAGE_FIELDS,
    TASKS,
    check_fields,
    field_value,
)


def compile_repository(
    path: str | Path, overrides: Sequence[str] = (), machine: MachineFacts = NO_GPU
) -> Plan:
    """Read, override, validate and compile the repository at `path` into a Plan for a
    machine with `machine`'s facts (found by the caller: `omni_server.gpu.discover(...)
    .facts()`; the default is a machine without a GPU)."""
    raw = load_repository(path)
    on_gpu.check(raw)
    # Where each stage lands is decided on the files with the command line's overrides
    # (`--stages.x.device cpu`); [on_gpu] cannot change it, so it applies under them after.
    probe = copy.deepcopy(raw)
    overridden = apply_overrides(probe, overrides)
    from_on_gpu: dict[str, str] = {}
    try:
        gpu_stages = _stages_on_gpu(probe, machine)
        from_on_gpu = on_gpu.apply(raw, gpu_stages)
        apply_overrides(raw, overrides)
        return _compile(raw, machine, gpu_stages)
    except RepositoryError as e:
        raise _blame_override(_blame_on_gpu(e, from_on_gpu, machine), overridden) from None


def _stages_on_gpu(raw: RawRepository, machine: MachineFacts) -> list[str]:
    out = []
    for name, rs in raw.stages.items():
        data = check_fields(rs.data, STAGE_FIELDS, file=rs.file, stage=name)
        fail = functools.partial(_stage_error, rs)
        if devices.choose(data, machine, fail).gpu:
            out.append(name)
    return out


def _stage_error(rs: RawStage, field: str, message: str) -> RepositoryError:
    return RepositoryError(message, file=rs.file, stage=rs.name, field=field)


def _blame_on_gpu(
    error: RepositoryError, from_on_gpu: Mapping[str, str], machine: MachineFacts
) -> RepositoryError:
    """Say so when the value breaking a rule came from an [on_gpu] table."""
    key = f"stages.{error.stage}.{error.field}" if error.stage is not None else error.field
    if key is None or key not in from_on_gpu:
        return error
    return RepositoryError(
        f"{error.reason} (the value comes from [on_gpu] in {from_on_gpu[key]}, applied: "
        f"{machine.describe()})",
        file=error.file,
        stage=error.stage,
        field=error.field,
    )


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


def _compile(raw: RawRepository, machine: MachineFacts, gpu_stages: list[str]) -> Plan:
    _check_repository_tables(raw)
    server = _server(raw)
    stages = {
        name: parse_stage(rs, machine, name in gpu_stages and on_gpu.TABLE in rs.data)
        for name, rs in raw.stages.items()
    }
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
    placement.check_machine(processes, stages, instances, machine, files, raw.file)
    return Plan(
        repository=raw.root,
        server=server,
        parameters=freeze(_table(raw, "parameters")),
        stages=FrozenMap(stages),
        models=FrozenMap(models),
        processes=FrozenMap(processes),
        instances=instances,
        edges=edges,
        machine=machine,
        on_gpu_applied=bool(gpu_stages) and bool(raw.data.get(on_gpu.TABLE)),
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
        audio_input = field_value(data, MODEL_FIELDS, "audio_input")
        if audio_input == "native" and not {"chat", "realtime"} & set(tasks):
            raise RepositoryError(
                "a model hears audio only through chat or realtime; its tasks are "
                f"{list(tasks)}: leave audio_input out, or add chat or realtime to tasks",
                file=raw.file,
                field=prefix + "audio_input",
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
            audio_input=audio_input,
        )
    return models
