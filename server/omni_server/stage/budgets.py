"""GPU memory budgets, enforced in each stage process before any of its backends initializes.

A stage's `gpu_memory_fraction` is the budget of the OS process it runs in, per GPU (the
compiler's rule, compiler/placement.py `gpu_budgets`): stages of one process share one CUDA
context and one allocator, so the process budgets the largest fraction its stages declare on a
GPU. Here that budget becomes torch's allocator cap on the device
(`torch.cuda.set_per_process_memory_fraction`): an allocation past it raises
`torch.OutOfMemoryError` in this process, which fails the request that made it
(stage/scheduling/oom.py) while the device may still have free memory for the other processes.
A GPU where no stage of the process declares a fraction (an unshared GPU: the compiler requires
one where it is shared) is not capped.

Checked at start: the device must have the budget free now (another process, or a stale one,
may hold it); else the stage cannot start, in one line naming the stage, the fraction and both
sizes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from omni_server.compiler.plan import ProcessInstance, StageSpec

from .scheduling.oom import describe

log = logging.getLogger(__name__)
_GiB = 1 << 30


class BudgetError(Exception):
    """A memory budget cannot be had at start; the message names the stage."""


def process_budgets(
    instance: ProcessInstance, stages: Mapping[str, StageSpec]
) -> dict[int, tuple[float, str]]:
    """GPU id -> (the process's budget there, the stage declaring it): the largest fraction its
    stages declare on that GPU (ties: the first stage)."""
    budgets: dict[int, tuple[float, str]] = {}
    for name, device in instance.devices.items():
        fraction = stages[name].gpu_memory_fraction
        if device is None or fraction is None:
            continue
        if fraction > budgets.get(device, (0.0, ""))[0]:
            budgets[device] = (fraction, name)
    return budgets


def enforce(
    instance: ProcessInstance, stages: Mapping[str, StageSpec], cuda: Any = None
) -> dict[int, float]:
    """Cap this process's allocator on each GPU it budgets; GPU id -> the fraction applied.

    `cuda` is `torch.cuda` (tests pass a stand-in with the same four functions). Without a
    usable CUDA nothing is capped: whether a GPU stage may start there is the GPU start
    check's decision (gpu/devices.py), not this one's. Raises BudgetError."""
    budgets = process_budgets(instance, stages)
    if not budgets:
        return {}
    if cuda is None:
        import torch

        cuda = torch.cuda
    if not cuda.is_available():
        return {}
    applied: dict[int, float] = {}
    for device, (fraction, stage) in sorted(budgets.items()):
        free, total = cuda.mem_get_info(device)
        want = fraction * total
        if free < want:
            raise BudgetError(
                f"stage {stage}: gpu_memory_fraction {fraction:g} of cuda:{device} is "
                f"{_gib(want)}, but only {_gib(free)} is free"
            )
        cuda.set_per_process_memory_fraction(fraction, device)  # before any allocation
        applied[device] = fraction
        log.info(
            "%s: allocator capped at gpu_memory_fraction %g of cuda:%d (%s; %s free)",
            instance.name,
            fraction,
            device,
            _gib(want),
            _gib(free),
        )
    return applied


def _gib(n: float) -> str:
    return f"{n / _GiB:.1f} GiB"


def initialize_oom(fraction: float | None, device: int | None, torch_message: str) -> str:
    """The start error of a stage whose initialize() ran out of GPU memory (its weights or its
    profile did not fit the process's cap, or the device was full): one line."""
    what = describe(torch_message)  # "out of GPU memory: tried to allocate 2.00 MiB on GPU 0"
    line = f"initialize() ran {what}"
    if fraction is not None and device is not None:
        line += f"; gpu_memory_fraction {fraction:g} of cuda:{device} caps its process"
    return line
