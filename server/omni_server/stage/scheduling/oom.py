"""Out of GPU memory inside a backend call fails the requests of that call, never the process.

torch raises `torch.OutOfMemoryError` when an allocation would pass the process's memory cap
(stage/budgets.py) or the device's memory. `guarded(fn, *args)` runs a backend call and turns
that error into `OutOfGPUMemory`, after letting the original go (its traceback holds the failed
call's frames, and with them its tensors) and handing the allocator's cached blocks back to the
device (`torch.cuda.empty_cache`), so the next request starts from the stage's steady state.
The schedulers fail the call's requests with it like any backend error; the stage host reports
it with the error code OUT_OF_GPU_MEMORY, which the HTTP layer names in its 500.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from omni_server.errors import OUT_OF_GPU_MEMORY

T = TypeVar("T")

_ASKED = re.compile(r"Tried to allocate ([0-9.]+ [KMGT]?i?B)")
_GPU = re.compile(r"GPU (\d+)")


class OutOfGPUMemory(RuntimeError):
    """A backend call ran out of GPU memory; the requests of that call fail, the stage goes on."""

    code = OUT_OF_GPU_MEMORY


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, _out_of_memory_types())


def _out_of_memory_types() -> tuple[type[BaseException], ...]:
    torch = sys.modules.get("torch")  # no torch imported: nothing could have raised its OOM
    return () if torch is None else (torch.OutOfMemoryError,)


def guarded(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args); torch's out-of-memory error becomes OutOfGPUMemory, the cache released."""
    try:
        return fn(*args)
    except _out_of_memory_types() as error:  # evaluated when an exception gets here
        message = describe(str(error))
    # Outside the except block the OOM and the frames it references are gone, so the tensors
    # of the failed call are free when the cache is emptied.
    release_cached_memory()
    raise OutOfGPUMemory(message)


def describe(torch_message: str) -> str:
    """'out of GPU memory: tried to allocate 2.00 GiB on GPU 0' (not torch's whole text: it
    lists other processes and allocator settings)."""
    asked = _ASKED.search(torch_message)
    gpu = _GPU.search(torch_message)
    detail = f"tried to allocate {asked.group(1)}" if asked else ""
    if gpu:
        detail += f" on GPU {gpu.group(1)}" if detail else f"GPU {gpu.group(1)}"
    return "out of GPU memory" + (f": {detail}" if detail else "")


def release_cached_memory() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
