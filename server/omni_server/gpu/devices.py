"""What this machine offers a plan's GPU stages, asked once in the server before any spawn.

`discover()` lists the CUDA GPUs through `nvidia-smi` (index and UUID) and looks for the MPS
control program. It never initialises CUDA here: the server process holds no CUDA context (a
context costs GPU memory, and a forked child of a process with one cannot use CUDA). The
server's own CUDA_VISIBLE_DEVICES is honoured, so `cuda:N` means what it means to a CUDA
program started from this environment: the N-th visible GPU.

`check_placement()` is the start check: every GPU a stage instance wants must exist, else one
line naming the stage, its instance and the device (the runtime fails to start, exit 1).
The CLI discovers the machine once and compiles for its `facts()` (`device = "auto"`).
Tests hand the runtime a `Machine` of their own instead of discovering one.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, replace

from omni_server.compiler.plan import MachineFacts, Plan
from omni_server.errors import PipelineError
from omni_server.gpu import host

MPS_CONTROL = "nvidia-cuda-mps-control"
_SMI_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Gpu:
    index: int  # as CUDA programs started from the server's environment number it
    uuid: str  # "GPU-..."; how MPS and CUDA_VISIBLE_DEVICES name it without ambiguity


@dataclass(frozen=True)
class Machine:
    gpus: tuple[Gpu, ...] = ()
    why_no_gpu: str = ""  # when `gpus` is empty: what discovery found (for the error line)
    mps_control: str | None = None  # path of nvidia-cuda-mps-control, None where absent
    cpus: int | None = None  # cores this server may use (gpu/host.py); None: not asked
    memory_bytes: int | None = None  # memory this server may use; None: not asked

    def gpu(self, index: int) -> Gpu | None:
        return self.gpus[index] if 0 <= index < len(self.gpus) else None

    def facts(self) -> MachineFacts:
        """What the compiler needs of this machine (it resolves `device = "auto"` with it)."""
        return MachineFacts(gpus=len(self.gpus), cpus=self.cpus, memory_bytes=self.memory_bytes)


def discover(environ: Mapping[str, str]) -> Machine:
    """The GPUs visible from `environ` (its CUDA_VISIBLE_DEVICES applied), the MPS control
    program on its PATH, and the CPU cores and memory this server may use."""
    return replace(_gpus(environ), cpus=host.cpus(), memory_bytes=host.memory_bytes())


def _gpus(environ: Mapping[str, str]) -> Machine:
    mps_control = shutil.which(MPS_CONTROL, path=environ.get("PATH"))
    smi = shutil.which("nvidia-smi", path=environ.get("PATH"))
    if smi is None:
        return Machine(why_no_gpu="nvidia-smi not found", mps_control=mps_control)
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Machine(why_no_gpu=f"nvidia-smi failed: {exc}", mps_control=mps_control)
    if out.returncode != 0:
        last = (out.stderr or out.stdout).strip().splitlines()[-1:] or [f"exit {out.returncode}"]
        return Machine(why_no_gpu=f"nvidia-smi: {last[0]}", mps_control=mps_control)
    physical = parse_smi(out.stdout)
    gpus = visible(physical, environ.get("CUDA_VISIBLE_DEVICES"))
    why = ""
    if not gpus:
        why = "CUDA_VISIBLE_DEVICES hides them all" if physical else "nvidia-smi lists none"
    return Machine(gpus=gpus, why_no_gpu=why, mps_control=mps_control)


def parse_smi(text: str) -> tuple[Gpu, ...]:
    """`index, uuid` lines of nvidia-smi's CSV, in index order; other lines are skipped."""
    gpus = []
    for line in text.splitlines():
        index, _, uuid = (part.strip() for part in line.partition(","))
        if index.isdigit() and uuid.startswith("GPU-"):
            gpus.append(Gpu(int(index), uuid))
    return tuple(sorted(gpus, key=lambda g: g.index))


def visible(physical: tuple[Gpu, ...], cuda_visible: str | None) -> tuple[Gpu, ...]:
    """The GPUs a CUDA program sees under CUDA_VISIBLE_DEVICES=`cuda_visible`, renumbered
    from 0 in its order. As CUDA does, the list ends at its first entry that names no GPU
    (an index out of range, an unknown UUID prefix, a MIG instance we cannot map)."""
    if cuda_visible is None:
        return physical
    by_index = {g.index: g for g in physical}
    chosen: list[Gpu] = []
    for entry in (e.strip() for e in cuda_visible.split(",")):
        if entry.isdigit():
            gpu = by_index.get(int(entry))
        else:
            matches = [g for g in physical if entry.startswith("GPU-") and g.uuid.startswith(entry)]
            gpu = matches[0] if len(matches) == 1 else None
        if gpu is None or gpu in chosen:
            break
        chosen.append(gpu)
    return tuple(Gpu(i, g.uuid) for i, g in enumerate(chosen))


def check_placement(plan: Plan, machine: Machine) -> None:
    """Raise PipelineError (one line) for the first GPU that a stage instance wants and this
    machine lacks: none at all, or an index past the last GPU (replica_devices included)."""
    for instance in plan.instances:
        for stage, device in instance.devices.items():
            if device is None or machine.gpu(device) is not None:
                continue
            who = f"stage {stage} ({instance.name}) wants cuda:{device}, but this machine has"
            n = len(machine.gpus)
            if n == 0:
                raise PipelineError(
                    f"{who} no usable CUDA GPU ({machine.why_no_gpu or 'none found'})",
                    code="unavailable",
                )
            count = "1 GPU (0)" if n == 1 else f"{n} GPUs (0-{n - 1})"
            raise PipelineError(f"{who} {count}", code="unavailable")


def uses_gpus(plan: Plan) -> bool:
    return any(d is not None for i in plan.instances for d in i.devices.values())
