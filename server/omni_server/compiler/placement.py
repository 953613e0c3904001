"""Processes, replicas and devices: which OS processes exist and which GPU each stage lands on.

Rules (from the reference design's topology and placement documents):
- stages naming one process share it; a TP stage owns its process, one OS process per rank;
- a replica copies the whole logical process; `replica_devices` gives N ids (N x T with TP
  size T), overrides the GPU of every GPU stage of the replica and leaves CPU stages alone;
- a GPU process with more than one replica must say where its replicas go;
- process-local edges never cross a process boundary (a replica copies both ends, so an edge
  inside one process stays local in every replica);
- memory fractions are declared, never inferred: required on every GPU stage of a GPU that
  hosts more than one OS process and on every GPU stage placed by `replica_devices`; the
  declared fractions on each GPU sum to at most `gpu_memory_limit`;
- weight sharing needs, per process whose replicas repeat a GPU, exactly one engine stage
  with tp_size 1 and a pinned max_total_tokens;
- the plan fits the machine it is compiled for (`check_machine`, where its facts are known):
  a logical process runs at most one OS process (replica x TP rank) per CPU core, and every
  stage process together needs at least `PROCESS_MEMORY_FLOOR` each of the machine's memory.
  A load's config (model control) goes through the same compile, so one call cannot fork
  more processes than the machine holds.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.plan import (
    BindingPolicy,
    DeviceRequest,
    Edge,
    FrozenMap,
    MachineFacts,
    ProcessInstance,
    ProcessSpec,
    ServerOptions,
    StageSpec,
)
from omni_server.compiler.schema import PROCESS_FIELDS, check_fields, field_value

# Sums of declared fractions are compared with this much slack (0.1 + 0.2 must fit 0.3).
EPSILON = 1e-9
# The least memory a stage process holds before any model: the interpreter, numpy and the
# stage host (42 MiB resident measured for `omni_server.stage.worker` alone), rounded up.
PROCESS_MEMORY_FLOOR = 64 << 20


def build_processes(
    stages: Mapping[str, StageSpec],
    table: Mapping[str, Any],
    files: Mapping[str, Path],
    repository_file: Path,
) -> dict[str, ProcessSpec]:
    members: dict[str, list[str]] = defaultdict(list)
    for spec in stages.values():  # pipeline order, so processes print upstream first
        members[spec.process].append(spec.name)

    for name, group in members.items():
        owners = [s for s in group if stages[s].tp_size > 1]
        if owners and len(group) > 1:
            other = next(s for s in group if s != owners[0])
            raise RepositoryError(
                f"process '{name}' belongs to TP stage '{owners[0]}' (tp_size "
                f"{stages[owners[0]].tp_size}), which owns its process; give '{other}' another "
                "process",
                file=files[other],
                stage=other,
                field="process",
            )

    for name, data in table.items():
        if name not in members:
            raise RepositoryError(
                f"no stage runs in process '{name}'; processes: {', '.join(members)}",
                file=repository_file,
                field=f"processes.{name}",
            )
        check_fields(data, PROCESS_FIELDS, file=repository_file, prefix=f"processes.{name}.")

    processes = {}
    for name, group in members.items():
        data = table.get(name, {})
        field = f"processes.{name}."
        tp_size = max(stages[s].tp_size for s in group)
        replicas = field_value(data, PROCESS_FIELDS, "num_replicas")
        devices = tuple(field_value(data, PROCESS_FIELDS, "replica_devices"))
        on_gpu = any(stages[s].on_gpu for s in group)
        if devices and not on_gpu:
            auto = any(stages[s].device is DeviceRequest.AUTO for s in group)
            hint = f" (only where they land on one: [on_gpu.processes.{name}])" if auto else ""
            raise RepositoryError(
                f"process '{name}' runs only CPU stages ({', '.join(group)}); replica_devices "
                f"places GPU stages{hint}",
                file=repository_file,
                field=field + "replica_devices",
            )
        if devices and len(devices) != replicas * tp_size:
            what = f"{replicas} replicas" + (f" x tp_size {tp_size}" if tp_size > 1 else "")
            raise RepositoryError(
                f"{len(devices)} ids for {what}; give exactly {replicas * tp_size}",
                file=repository_file,
                field=field + "replica_devices",
            )
        if on_gpu and replicas > 1 and not devices:
            raise RepositoryError(
                f"a GPU process with {replicas} replicas must say where each goes: "
                f"replica_devices = [{replicas * tp_size} GPU ids]",
                file=repository_file,
                field=field + "replica_devices",
            )
        for r in range(replicas if devices else 0):
            ranks = devices[r * tp_size : (r + 1) * tp_size]
            if len(set(ranks)) != len(ranks):
                raise RepositoryError(
                    f"replica {r} puts two TP ranks on one GPU ({list(ranks)}); TP ranks need "
                    "distinct GPUs",
                    file=repository_file,
                    field=field + "replica_devices",
                )
        processes[name] = ProcessSpec(
            name=name,
            stages=tuple(group),
            num_replicas=replicas,
            replica_devices=devices,
            tp_size=tp_size,
            binding=BindingPolicy(field_value(data, PROCESS_FIELDS, "binding")),
        )
    return processes


def build_instances(
    processes: Mapping[str, ProcessSpec], stages: Mapping[str, StageSpec]
) -> tuple[ProcessInstance, ...]:
    """One OS process per replica per TP rank, every GPU stage resolved to its device."""
    out = []
    for proc in processes.values():
        t = proc.tp_size
        for replica in range(proc.num_replicas):
            for rank in range(t):
                devices: dict[str, int | None] = {}
                for name in proc.stages:
                    spec = stages[name]
                    if not spec.on_gpu:
                        devices[name] = None
                    elif proc.replica_devices:
                        devices[name] = proc.replica_devices[replica * t + rank]
                    else:
                        devices[name] = spec.gpu[rank]
                out.append(
                    ProcessInstance(
                        process=proc.name,
                        replica=replica,
                        tp_rank=rank,
                        stages=proc.stages,
                        devices=FrozenMap(devices),
                        tp_size=t,
                    )
                )
    return tuple(out)


def check_process_local(
    edges: tuple[Edge, ...],
    stages: Mapping[str, StageSpec],
    processes: Mapping[str, ProcessSpec],
    files: Mapping[str, Path],
) -> None:
    for edge in edges:
        if not edge.process_local:
            continue
        src, dst = stages[edge.src], stages[edge.dst]
        tp = next((s for s in (src, dst) if s.tp_size > 1), None)
        if tp is not None:
            why = (
                f"'{tp.name}' is a TP stage (tp_size {tp.tp_size}) and runs in its own "
                "processes, one per rank"
            )
        elif src.process != dst.process:
            why = (
                f"'{src.name}' runs in process '{src.process}' and '{dst.name}' in "
                f"'{dst.process}'; give both the same process"
            )
        else:
            continue
        raise RepositoryError(
            f"process-local edge {edge.src} -> {edge.dst} would cross a process boundary: {why}",
            file=files[src.name],
            stage=src.name,
            field="process_local",
        )


def _gpu_occupancy(
    instances: tuple[ProcessInstance, ...],
) -> dict[int, list[tuple[ProcessInstance, str]]]:
    """GPU id -> (instance, stage) for every GPU stage placed on it."""
    by_gpu: dict[int, list[tuple[ProcessInstance, str]]] = defaultdict(list)
    for inst in instances:
        for stage, device in inst.devices.items():
            if device is not None:
                by_gpu[device].append((inst, stage))
    return dict(sorted(by_gpu.items()))


def check_memory(
    instances: tuple[ProcessInstance, ...],
    stages: Mapping[str, StageSpec],
    processes: Mapping[str, ProcessSpec],
    server: ServerOptions,
    files: Mapping[str, Path],
    repository_file: Path,
) -> None:
    for proc in processes.values():
        if not proc.replica_devices:
            continue
        for name in proc.stages:
            spec = stages[name]
            if spec.on_gpu and spec.gpu_memory_fraction is None:
                raise RepositoryError(
                    f"process '{proc.name}' is placed by replica_devices, so each of its GPU "
                    "stages must declare gpu_memory_fraction (fractions are never inferred)",
                    file=files[name],
                    stage=name,
                    field="gpu_memory_fraction",
                )
    for gpu, placed in _gpu_occupancy(instances).items():
        owners = sorted({inst.name for inst, _ in placed})
        if len(owners) > 1:
            for _, name in placed:
                if stages[name].gpu_memory_fraction is None:
                    raise RepositoryError(
                        f"GPU {gpu} is shared by {', '.join(owners)}, so every GPU stage on it "
                        "must declare gpu_memory_fraction (fractions are never inferred)",
                        file=files[name],
                        stage=name,
                        field="gpu_memory_fraction",
                    )
        budgets = gpu_budgets(placed, stages)
        total = sum(f for f, _ in budgets.values())
        if total > server.gpu_memory_limit + EPSILON:
            parts = ", ".join(f"{inst} {f:g}" for inst, (f, _) in budgets.items())
            last = next(reversed(budgets.values()))[1]
            raise RepositoryError(
                f"GPU {gpu} is over budget: declared fractions sum to {total:.3g} ({parts}) > "
                f"gpu_memory_limit {server.gpu_memory_limit:g} ([server] in "
                f"{repository_file.name})",
                file=files[last],
                stage=last,
                field="gpu_memory_fraction",
            )


def gpu_budgets(
    placed: list[tuple[ProcessInstance, str]], stages: Mapping[str, StageSpec]
) -> dict[str, tuple[float, str]]:
    """Instance name -> (its declared budget on this GPU, the stage declaring it).

    Stages of one OS process share one CUDA context and allocator, and a stage's fraction is
    the budget of the process it runs in (the reference design's process-scoped
    `total_gpu_memory_fraction`), so an instance counts once, with the largest fraction its
    stages declare on this GPU. Instances count separately: two replicas budget twice.
    """
    budgets: dict[str, tuple[float, str]] = {}
    for inst, name in placed:
        fraction = stages[name].gpu_memory_fraction
        if fraction is not None and fraction > budgets.get(inst.name, (0.0, ""))[0]:
            budgets[inst.name] = (fraction, name)
    return budgets


def sharing_processes(
    instances: tuple[ProcessInstance, ...], processes: Mapping[str, ProcessSpec]
) -> list[str]:
    """Processes whose replicas repeat a GPU id: the weight-sharing groups when it is on."""
    out = []
    for proc in processes.values():
        seen: set[int] = set()
        for inst in instances:
            if inst.process != proc.name:
                continue
            gpus = {d for d in inst.devices.values() if d is not None}
            if gpus & seen:
                out.append(proc.name)
                break
            seen |= gpus
    return out


def check_weight_share(
    instances: tuple[ProcessInstance, ...],
    stages: Mapping[str, StageSpec],
    processes: Mapping[str, ProcessSpec],
    server: ServerOptions,
    files: Mapping[str, Path],
    repository_file: Path,
) -> None:
    if not server.weight_share:
        return
    for name in sharing_processes(instances, processes):
        proc = processes[name]
        engines = [s for s in proc.stages if stages[s].engine is not None]
        if len(engines) != 1:
            raise RepositoryError(
                f"weight_share = on makes process '{name}' (replicas repeat a GPU) a sharing "
                f"group, which needs exactly one engine stage ([engine] table); it has "
                f"{len(engines)}" + (f": {', '.join(engines)}" if engines else ""),
                file=repository_file,
                field="server.weight_share",
            )
        engine = stages[engines[0]]
        if engine.tp_size != 1:
            raise RepositoryError(
                f"weight sharing needs tp_size = 1 for engine stage '{engine.name}' of process "
                f"'{name}' (it is {engine.tp_size})",
                file=files[engine.name],
                stage=engine.name,
                field="tp_size",
            )
        assert engine.engine is not None
        if engine.engine.max_total_tokens is None:
            raise RepositoryError(
                "weight_share = on needs a pinned KV budget: a follower replica attaches after "
                "its dummy weights are freed and cannot profile one; set [engine] "
                "max_total_tokens",
                file=files[engine.name],
                stage=engine.name,
                field="engine.max_total_tokens",
            )


def check_machine(
    processes: Mapping[str, ProcessSpec],
    stages: Mapping[str, StageSpec],
    instances: tuple[ProcessInstance, ...],
    machine: MachineFacts,
    files: Mapping[str, Path],
    repository_file: Path,
) -> None:
    """The plan's stage processes fit `machine` (a fact not known is not checked).

    Cores: a replica (each of its TP ranks) is an OS process that needs a core to make
    progress; more of one logical process than the cores only take turns on the same cores,
    each holding its memory, so they are refused. Memory: every stage process together holds
    at least PROCESS_MEMORY_FLOOR each."""
    for proc in processes.values():
        count = proc.num_replicas * proc.tp_size
        if machine.cpus is None or count <= machine.cpus:
            continue
        replicas = f"{proc.num_replicas} replica{'s' if proc.num_replicas > 1 else ''}"
        what = replicas + (f" x tp_size {proc.tp_size}" if proc.tp_size > 1 else "")
        most = max(machine.cpus // proc.tp_size, 0)
        message = (
            f"process '{proc.name}' would run {count} OS processes ({what}) on a machine with "
            f"{machine.cpus} CPU core{'s' if machine.cpus > 1 else ''}; each needs a core of "
            "its own (more only take turns on the same cores, each holding its memory)"
        )
        if proc.num_replicas > 1 or proc.tp_size == 1:
            raise RepositoryError(
                f"{message}: at most {most} replicas here",
                file=repository_file,
                field=f"processes.{proc.name}.num_replicas",
            )
        tp = next(s for s in proc.stages if stages[s].tp_size == proc.tp_size)
        raise RepositoryError(
            f"{message}: at most tp_size {machine.cpus} here",
            file=files[tp],
            stage=tp,
            field="tp_size",
        )
    need = len(instances) * PROCESS_MEMORY_FLOOR
    if machine.memory_bytes is not None and need > machine.memory_bytes:
        counts = {p.name: p.num_replicas * p.tp_size for p in processes.values()}
        largest = max(counts, key=lambda name: counts[name])
        raise RepositoryError(
            f"the plan starts {len(instances)} stage processes, which hold at least "
            f"{need >> 20} MiB ({PROCESS_MEMORY_FLOOR >> 20} MiB each before any model) of "
            f"the {machine.memory_bytes >> 20} MiB this machine has; process '{largest}' "
            f"runs {counts[largest]} of them",
            file=repository_file,
            field=f"processes.{largest}.num_replicas",
        )
