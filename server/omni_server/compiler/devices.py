"""Where a stage lands on this machine: its `device` request against the machine's facts.

`device` absent: `gpu` decides (its ids, or the CPU without it), as before `device` existed.
`"gpu"`: the `gpu` ids (default 0..tp_size-1), whatever the machine; a machine without them
fails the start (the runtime's check, exit 1 naming the stage), not the compile.
`"cpu"`: the CPU; `gpu` and `gpu_memory_fraction` stay declared and unused.
`"auto"`: the `gpu` ids when the machine has every one of them, else the CPU.

The machine's facts are handed in (`MachineFacts`); nothing here looks at the hardware.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.plan import DeviceRequest, MachineFacts
from omni_server.compiler.schema import STAGE_FIELDS, field_value

Fail = Callable[[str, str], RepositoryError]  # (field, message) -> the error to raise


@dataclass(frozen=True)
class DeviceChoice:
    request: DeviceRequest | None  # `device` as declared; None: not declared
    gpu: tuple[int, ...]  # the GPU ids it runs on, one per TP rank; () = the CPU
    tp_size: int
    gpu_memory_fraction: float | None  # the budget where it runs (None on the CPU)


def choose(data: dict[str, Any], machine: MachineFacts, fail: Fail) -> DeviceChoice:
    """The device of one stage whose fields are type-checked (`schema.check_fields`)."""
    request = DeviceRequest(data["device"]) if "device" in data else None
    ids = _ids(data.get("gpu"))
    if "gpu" in data and not ids:
        raise fail("gpu", 'gpu = [] names no GPU; drop the field, or set device = "cpu"')
    # Without a GPU a TP stage runs its ranks on the CPU (torch.distributed over gloo).
    tp_size: int = field_value(data, STAGE_FIELDS, "tp_size")
    if ids and len(ids) != tp_size:
        raise fail(
            "gpu", f"{len(ids)} GPU ids for tp_size = {tp_size}; give exactly one id per TP rank"
        )
    if len(set(ids)) != len(ids):
        raise fail("gpu", f"TP ranks may not share a GPU: {list(ids)}")
    fraction = data.get("gpu_memory_fraction")
    if fraction is not None and request is None and not ids:
        raise fail(
            "gpu_memory_fraction",
            'a CPU stage budgets no GPU memory; set gpu (or device = "auto") or drop it',
        )
    wanted = ids or tuple(range(tp_size))
    if request is None:
        gpu = ids
    elif request is DeviceRequest.CPU:
        gpu = ()
    elif request is DeviceRequest.GPU:
        gpu = wanted
    else:
        gpu = wanted if machine.has_gpus(wanted) else ()
    return DeviceChoice(
        request=request,
        gpu=gpu,
        tp_size=tp_size,
        gpu_memory_fraction=float(fraction) if fraction is not None and gpu else None,
    )


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)
