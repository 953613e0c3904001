"""On the CPU, a model's weights in one buffer of 2 MiB pages (transparent huge pages).

A batch-1 decode step on the CPU streams every weight once (SmolLM2-135M in float32: 540 MB a
token). In 4 KiB pages that is ~132k TLB entries a step, each a page walk, and on a loaded
machine a walk that misses the caches too; in 2 MiB pages it is ~260. The kernel's THP mode is
often `madvise` (this machine's): anonymous memory gets huge pages only when asked. So the
parameters become views into one anonymous mapping advised MADV_HUGEPAGE, in module order (the
order a forward reads them). Measured in one process on the shared 2-core machine: 52.7 against
55.4 CPU ms a SmolLM2 step (docs/engine.md). Where THP is off, or the platform has no such
advice, the mapping is ordinary pages: the same numbers, without the TLB saving.
"""

from __future__ import annotations

import mmap

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor starts on a cache line, as torch's allocator places them


def pack_parameters(model: nn.Module, dtype: torch.dtype) -> int:
    """Make every parameter of `model` a `dtype` view into one huge-page buffer, its values
    cast and copied; a meta parameter (built, not loaded) gets its space uninitialized. Returns
    the bytes packed. The buffer lives as long as a tensor views it."""
    owners = [
        (module, name, param)
        for module in model.modules()
        for name, param in module.named_parameters(recurse=False)
    ]
    if not owners:
        return 0
    element = torch.empty((), dtype=dtype).element_size()
    sizes = [-(-p.numel() * element // _ALIGN) * _ALIGN for _, _, p in owners]
    total = sum(sizes)
    buffer = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        buffer.madvise(advice)
    raw = torch.frombuffer(buffer, dtype=torch.uint8)  # the tensor holds the mapping
    offset = -raw.data_ptr() % HUGE_PAGE  # THP backs only 2 MiB-aligned stretches
    for (module, name, param), size in zip(owners, sizes, strict=True):
        view = raw[offset : offset + param.numel() * element].view(dtype).view(param.shape)
        if not param.is_meta:
            view.copy_(param.detach())  # casts to dtype
        setattr(module, name, nn.Parameter(view, requires_grad=False))
        offset += size
    return total
