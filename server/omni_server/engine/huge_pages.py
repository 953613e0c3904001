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


def pack_parameters(model: nn.Module, dtype: torch.dtype, matmul_weights: set[str]) -> int:
    """Make every parameter of `model` a `dtype` view into one huge-page buffer, its values
    cast and copied; a meta parameter (built, not loaded) gets its space uninitialized. Those
    named in `matmul_weights` (the ones a step multiplies by) may be stored by columns
    (`columns_first`). Returns the bytes packed. The buffer lives as long as a tensor views it."""
    owners = [
        (module, name, param, f"{prefix}.{name}" if prefix else name)
        for prefix, module in model.named_modules()
        for name, param in module.named_parameters(recurse=False)
    ]
    if not owners:
        return 0
    element = torch.empty((), dtype=dtype).element_size()
    sizes = [-(-p.numel() * element // _ALIGN) * _ALIGN for _, _, p, _ in owners]
    total = sum(sizes)
    buffer = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        buffer.madvise(advice)
    raw = torch.frombuffer(buffer, dtype=torch.uint8)  # the tensor holds the mapping
    offset = -raw.data_ptr() % HUGE_PAGE  # THP backs only 2 MiB-aligned stretches
    for (module, name, param, path), size in zip(owners, sizes, strict=True):
        flat = raw[offset : offset + param.numel() * element].view(dtype)
        if path in matmul_weights and columns_first(param, dtype):
            view = _by_columns(flat, param)
        else:
            view = flat.view(param.shape)
        if not param.is_meta:
            view.copy_(param.detach())  # casts to dtype
        setattr(module, name, nn.Parameter(view, requires_grad=False))
        offset += size
    return total


def columns_first(param: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a weight named for the column order is stored column by column (strides
    (1, rows)) instead of row by row.

    A decode step multiplies one row by each weight: `x @ W.T`. With W [out, in] stored by rows
    that is a matrix-vector product over W's rows; stored by columns, W.T is an ordinary
    row-major [in, out] matrix and the product streams it as a GEMM's B operand. In float32 on
    one thread, for the weights wider than they are deep (out > in: the fused QKV, gate/up and
    the vocabulary head), the second form reads them 1.4-2x as fast on the development machine
    (the 49152 x 576 head 12.6 -> 7.0 ms at one row, gate/up 0.75 -> 0.39 ms; docs/engine.md);
    for the deeper ones (the down projection) it is slower, so those stay by rows. From 4 rows
    on the row order is the faster one again: EngineConfig.cpu_weight_order chooses. The
    logical shape and every op on it are unchanged (copy_, shard, embedding lookups); only the
    memory order differs. Fixed by shape, not timed at load, so a model's numbers are the same
    in every process."""
    return dtype == torch.float32 and param.dim() == 2 and param.shape[0] > param.shape[1]


def _by_columns(flat: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    rows, cols = param.shape
    return flat.view(cols, rows).t()  # [rows, cols] with strides (1, rows)
