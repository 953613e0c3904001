"""Paged decode attention on CUDA: a Triton kernel that reads only the live KV of each request.

The CPU path (attention.py) gathers each request's slots and pads the batch to its longest
context; on a GPU that costs a gather, a padded copy and four kernels a layer, and in a CUDA
graph the padding goes to the context bucket. This kernel walks each request's block table
instead: one program per (request, KV head, context partition) loads its G = H / Hkv query rows
once, then streams its context in tiles of whole KV blocks with an online softmax (the
flash-decoding recurrence), so a request of context c reads c keys and values, never more.

  q            [B, H, D]          this step's query rows (RoPE applied)
  k/v_cache    [S, Hkv, D]        one layer's cache (this step's K/V already written)
  block_tables [B, W] int32       request b's blocks; entries past its context are never read
  context_lens [B] int32          request b attends to positions 0 .. context_lens[b] - 1

Long contexts split into partitions of PARTITION tokens (a second, tiny kernel merges their
partial results), so a batch of one still spreads over the GPU. The grid depends only on B, Hkv
and W (the table's width), never on the context lengths: a CUDA graph captured for a table width
replays for any contexts up to it, and partitions past a request's context exit at once.
A context length of 0 (a padded graph row) writes zeros.

Triton is imported on first use: a CPU install never needs it (`available()` says whether the
kernel can run).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

PARTITION = 512  # tokens a program reads at most; contexts beyond split over more programs


@functools.cache
def available() -> bool:
    """Triton is importable and a CUDA device exists: the kernel can run."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_paged(choice: str, device: torch.device) -> bool:
    """Whether decode attention runs this kernel, for EngineConfig.decode_attention `choice`:
    "auto" where it can run, "gather" never, "paged" always (ValueError where it cannot)."""
    runs = device.type == "cuda" and available()
    if choice == "paged" and not runs:
        raise ValueError(
            f"engine.decode_attention = 'paged' needs a CUDA device and Triton; the engine is on "
            f"{device}{'' if device.type != 'cuda' else ' without Triton'}"
        )
    return runs and choice != "gather"


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [S, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, W] int32
    context_lens: torch.Tensor,  # [B] int32
    block_size: int,
) -> torch.Tensor:  # [B, H, D]
    kernels = _kernels()
    b, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    width = block_tables.shape[1]
    blocks_per_tile = max(1, 64 // block_size)  # a tile of >= 64 keys: enough work per step
    tile = blocks_per_tile * block_size
    partition = max(tile, PARTITION // tile * tile)
    # A small batch spreads its contexts over more programs (the H200 has 132 SMs).
    while partition > tile and b * num_kv_heads * -(-(width * block_size) // partition) < 128:
        partition = max(tile, partition // 2 // tile * tile)
    num_partitions = -(-(width * block_size) // partition)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    group_pad = max(16, 1 << (group - 1).bit_length())  # tl.dot wants M >= 16
    common = dict(
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCKS_PER_TILE=blocks_per_tile,
        PARTITION_SIZE=partition,
        IEEE=q.dtype == torch.float32,
    )
    if num_partitions == 1:
        kernels.attend[(b, num_kv_heads, 1)](
            q, k_cache, v_cache, block_tables, context_lens, out, out, out,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            block_tables.stride(0), out.stride(0), out.stride(1), 0, 0, 0,
            scale, SPLIT=False, **common, num_warps=4,
        )  # fmt: skip
        return out
    partial = torch.empty(b, num_heads, num_partitions, head_dim, dtype=torch.float32,
                          device=q.device)  # fmt: skip
    lse = torch.empty(b, num_heads, num_partitions, dtype=torch.float32, device=q.device)
    kernels.attend[(b, num_kv_heads, num_partitions)](
        q, k_cache, v_cache, block_tables, context_lens, out, partial, lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0), partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1), scale, SPLIT=True, **common, num_warps=4,
    )  # fmt: skip
    kernels.merge[(b, num_heads)](
        partial, lse, context_lens, out,
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_PARTITIONS=num_partitions, PARTITIONS_PAD=1 << (num_partitions - 1).bit_length(),
        PARTITION_SIZE=partition, HEAD_DIM=head_dim, GROUP=group, num_warps=4,
    )  # fmt: skip
    return out


class _Kernels:
    def __init__(self, attend: Any, merge: Any) -> None:
        self.attend = attend
        self.merge = merge


@functools.cache
def _kernels() -> _Kernels:
    """Define the kernels (Triton is imported here, on the first CUDA decode)."""
    import triton
    import triton.language as tl

    @triton.jit
    def attend(
        q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_tb,
        stride_ob, stride_oh, stride_op, stride_lb, stride_lh,
        scale,
        SPLIT: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCKS_PER_TILE: tl.constexpr,
        PARTITION_SIZE: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        # SPLIT: out_ptr unused; partial [B, H, P, D] (normalized) and lse [B, H, P] written.
        # not SPLIT: one partition; out [B, H, D] written in q's dtype.
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        part = tl.program_id(2)
        context = tl.load(lens_ptr + seq)
        rows = tl.arange(0, GROUP_PAD)  # query rows of this KV head (G real, padded to 16)
        dims = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + rows
        row_ok = rows < GROUP
        q = tl.load(
            q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )  # [GP, D]
        TILE: tl.constexpr = BLOCK_SIZE * BLOCKS_PER_TILE
        keys = tl.arange(0, TILE)
        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
        begin = part * PARTITION_SIZE
        end = tl.minimum(begin + PARTITION_SIZE, context)
        for start in range(begin, end, TILE):
            pos = start + keys
            live = pos < end
            block = tl.load(table_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=live, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
            kv_off = slot[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
            k = tl.load(k_ptr + kv_off, mask=live[:, None], other=0.0)  # [TILE, D]
            v = tl.load(v_ptr + kv_off, mask=live[:, None], other=0.0)
            if IEEE:  # noqa: SIM108  (a Triton branch on a constexpr)
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(live[None, :], s * scale, float("-inf"))  # [GP, TILE]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:  # noqa: SIM108  (a Triton branch on a constexpr)
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        has = l_i > 0  # False: this partition lies past the context (or a padded row)
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        if SPLIT:
            base = seq * stride_ob + heads * stride_oh + part * stride_op
            tl.store(part_ptr + base[:, None] + dims[None, :], o, mask=row_ok[:, None])
            lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + part, lse, mask=row_ok)
        else:
            out = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :]
            tl.store(out, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def merge(
        part_ptr, lse_ptr, lens_ptr, out_ptr,
        stride_pb, stride_ph, stride_pp, stride_lb, stride_lh, stride_ob, stride_oh,
        NUM_PARTITIONS: tl.constexpr, PARTITIONS_PAD: tl.constexpr,
        PARTITION_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        head = tl.program_id(1)
        parts = tl.arange(0, PARTITIONS_PAD)
        dims = tl.arange(0, HEAD_DIM)
        context = tl.load(lens_ptr + seq)
        used = (parts < NUM_PARTITIONS) & (parts * PARTITION_SIZE < context)
        lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + parts, mask=used,
                      other=float("-inf"))  # fmt: skip
        top = tl.max(lse, axis=0)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.where(used, tl.exp(lse - top), 0.0)  # [P]
        total = tl.sum(w, axis=0)
        base = part_ptr + seq * stride_pb + head * stride_ph
        o = tl.load(base + parts[:, None] * stride_pp + dims[None, :], mask=used[:, None],
                    other=0.0)  # fmt: skip
        o = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims,
                 o.to(out_ptr.dtype.element_ty))  # fmt: skip

    return _Kernels(attend, merge)
