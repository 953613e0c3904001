"""A compiled Plan as text: the resolved config (TOML / JSON) and the process topology.

The resolved config uses the file format's own fields with every default filled in and every
device resolved for this machine ([on_gpu] merged, `device` applied to `gpu`), so it can be
read back as documentation of what the server will run. The topology prints one line per
logical process (`tts_frontend : preprocessing, audio_encoder`), then one line per OS process
(`talker_ar@r0 -> GPU 1`), then what each GPU hosts, then each stage's device and why.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import tomli_w

from omni_server.compiler.files import REPOSITORY_FILE
from omni_server.compiler.placement import gpu_budgets
from omni_server.compiler.plan import DeviceRequest, Plan, ProcessInstance, SchedulerKind, StageSpec

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def config_dict(plan: Plan) -> dict[str, Any]:
    out: dict[str, Any] = {
        "server": {
            "mps": str(plan.server.mps),
            "weight_share": "on" if plan.server.weight_share else "off",
            "gpu_memory_limit": plan.server.gpu_memory_limit,
            "stage_timeout_s": plan.server.stage_timeout_s,
        },
        "models": {m.id: _model(m) for m in plan.models.values()},
        "processes": {
            p.name: {
                "num_replicas": p.num_replicas,
                "replica_devices": list(p.replica_devices),
                "binding": p.binding,
            }
            for p in plan.processes.values()
        },
        "stages": {s.name: _stage(s) for s in plan.stages.values()},
    }
    if plan.parameters:
        out["parameters"] = _thaw(plan.parameters)
    return out


def config_toml(plan: Plan) -> str:
    lines: list[str] = []
    _emit_table(config_dict(plan), "", lines)
    return "\n".join(lines).strip() + "\n"


def _emit_table(table: Mapping[str, Any], name: str, lines: list[str]) -> None:
    """TOML with inline arrays (tomli_w writes one array item per line, unreadable here)."""
    scalars = [(k, v) for k, v in table.items() if not isinstance(v, Mapping)]
    if name and (scalars or not table):
        lines.append(f"[{name}]")  # also for an empty table: [engine] alone marks an engine
    lines += [f"{_key(k)} = {_value(v)}" for k, v in scalars]
    if name and (scalars or not table):
        lines.append("")
    for key, value in table.items():
        if isinstance(value, Mapping):
            _emit_table(value, f"{name}.{_key(key)}" if name else _key(key), lines)


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + " }"
    return tomli_w.dumps({"v": value})[len("v = ") :].strip()


def config_json(plan: Plan) -> str:
    # default=str: TOML dates and times in [parameters] have no JSON type; print them as text.
    return json.dumps(config_dict(plan), indent=2, default=str)


def _model(m: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"entry": m.entry, "tasks": list(m.tasks), "aliases": list(m.aliases)}
    out["stages"] = list(m.stages)
    out["voices"] = list(m.voices)
    if m.default_voice is not None:
        out["default_voice"] = m.default_voice
    out["description"] = m.description
    if m.language is not None:
        out["language"] = m.language
    if m.voice_aliases:
        out["voice_aliases"] = dict(m.voice_aliases)
    if m.hears_audio:  # shown where it differs from the default, "transcribe"
        out["audio_input"] = m.audio_input
    return out


def _stage(s: StageSpec) -> dict[str, Any]:
    backend = s.backend.file.relative_to(s.directory).as_posix()
    out: dict[str, Any] = {"backend": f"{backend}:{s.backend.class_name}", "process": s.process}
    if s.gpu:
        out["gpu"] = list(s.gpu)
    out["tp_size"] = s.tp_size
    if s.gpu_memory_fraction is not None:
        out["gpu_memory_fraction"] = s.gpu_memory_fraction
    if s.terminal:
        out["terminal"] = True
    else:
        out["next"] = list(s.next)
    if s.route is not None:
        out["route"] = s.route
    if s.wait_for:
        out["wait_for"] = list(s.wait_for)
        out["merge"] = s.merge
    out["stream_to"] = list(s.stream_to)
    out["process_local"] = list(s.process_local)
    out["scheduler"] = {
        "kind": str(s.scheduler.kind),
        "max_batch_size": s.scheduler.max_batch_size,
        "max_queue_delay_ms": s.scheduler.max_queue_delay_ms,
    }
    if s.scheduler.kind is SchedulerKind.STREAM:  # the only kind it applies to
        out["scheduler"]["first_chunk_lane"] = s.scheduler.first_chunk_lane
    if s.timeout_s is not None:
        out["timeout_s"] = s.timeout_s
    if s.voice_cloning:
        out["voice_cloning"] = True
    if s.engine is not None:
        out["engine"] = _thaw(s.engine.settings)
    if s.sampling.declared():
        out["sampling"] = s.sampling.declared()
    if s.parameters:
        out["parameters"] = _thaw(s.parameters)
    return out


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


# ---- topology -----------------------------------------------------------------------------


def topology_text(plan: Plan) -> str:
    lines = ["# processes: stages sharing one OS process"]
    width = max(len(p) for p in plan.processes)
    for proc in plan.processes.values():
        lines.append(f"{proc.name:<{width}} : {', '.join(proc.stages)}")

    lines += ["", "# instances: one OS process per replica (and TP rank)"]
    width = max(len(i.name) for i in plan.instances)
    for inst in plan.instances:
        lines.append(f"{inst.name:<{width}} -> {_placement(inst)}")

    by_gpu: dict[int, list[tuple[ProcessInstance, str]]] = defaultdict(list)
    for inst in plan.instances:
        for stage, device in inst.devices.items():
            if device is not None:
                by_gpu[device].append((inst, stage))
    if by_gpu:
        lines += ["", "# gpus: what each GPU hosts (declared memory fractions)"]
        for gpu, placed in sorted(by_gpu.items()):
            names = " + ".join(dict.fromkeys(inst.name for inst, _ in placed))
            budgets = gpu_budgets(placed, plan.stages)
            budget = ""
            if budgets:
                total = sum(f for f, _ in budgets.values())
                budget = f"  ({total:.3g} of {plan.server.gpu_memory_limit:g})"
            lines.append(f"GPU {gpu} : {names}{budget}")

    why = plan.machine.describe()
    if plan.on_gpu_applied:
        why += f"; [on_gpu] of {REPOSITORY_FILE} applied"
    lines += ["", f"# devices: where each stage runs and why (this machine: {why})"]
    width = max(len(s) for s in plan.stages)
    for spec in plan.stages.values():
        lines.append(f"{spec.name:<{width}} : {_device_choice(plan, spec)}")
    return "\n".join(lines) + "\n"


def _device_choice(plan: Plan, spec: StageSpec) -> str:
    """`cuda:0 bfloat16  (device = "auto": 1 GPU found; [on_gpu] applied)`."""
    ids = list(
        dict.fromkeys(i.devices[spec.name] for i in plan.instances if spec.name in i.devices)
    )
    where = ", ".join("cpu" if d is None else f"cuda:{d}" for d in ids)
    dtype = spec.engine.settings.get("dtype") if spec.engine is not None else None
    if dtype is not None:
        where += f" {dtype}"
    machine = plan.machine
    if spec.device is None:
        reasons = [f"gpu = {_value(_one(spec.gpu))}" if spec.gpu else "no device declared"]
    else:
        reason = f'device = "{spec.device}"'
        if spec.device is DeviceRequest.AUTO:
            reason += f": {machine.describe()}"
            if not spec.gpu and machine.gpus > 0:
                reason += ", not every one it needs"
        reasons = [reason]
    if spec.gpu and not machine.has_gpus(spec.gpu):
        reasons.append(f"not on this machine: {machine.describe()}")
    process = plan.process_of(spec.name)
    if spec.gpu and process.replica_devices:
        reasons.append(f"replica_devices of process {process.name}")
    if spec.on_gpu_applied:
        reasons.append("[on_gpu] applied")
    return f"{where}  ({'; '.join(reasons)})"


def _one(ids: tuple[int, ...]) -> int | list[int]:
    return ids[0] if len(ids) == 1 else list(ids)


def _placement(inst: ProcessInstance) -> str:
    """`GPU 1`, `CPU`, or `GPU 0: a, b; CPU: c` when the stages of one process differ."""
    groups: dict[str, list[str]] = defaultdict(list)
    for stage, device in inst.devices.items():
        groups["CPU" if device is None else f"GPU {device}"].append(stage)
    if len(groups) == 1:
        return next(iter(groups))
    return "; ".join(f"{where}: {', '.join(stages)}" for where, stages in groups.items())
