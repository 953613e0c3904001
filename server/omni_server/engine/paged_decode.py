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

Long contexts split into partitions of PARTITION tokens, so a batch of one still spreads over
the GPU. Their partial results are merged in the same kernel: each program of a (request, KV
head) writes its partial output and log-sum-exp, then takes a ticket from that pair's counter
(an acq_rel atomic after a barrier: its stores are visible to whoever takes the last ticket);
the program with the last ticket merges all partitions and puts the counter back to 0, so the
counters are zero between launches and a captured graph replays them as they are. No second
kernel: one launch a layer instead of two (the merge was 30 kernels, 44 us of SmolLM2's batch-1
step). The grid depends only on B, Hkv
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
    out = torch.empty(b, num_heads, head_dim, dtype=q.dtype, device=q.device)  # contiguous
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
            q, k_cache, v_cache, block_tables, context_lens, out, out, out, context_lens,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            block_tables.stride(0), out.stride(0), out.stride(1), 0, 0, 0,
            scale, SPLIT=False, NUM_PARTITIONS=1, PARTITIONS_PAD=1, **common, num_warps=4,
        )  # fmt: skip
        return out
    partial = torch.empty(b, num_heads, num_partitions, head_dim, dtype=torch.float32,
                          device=q.device)  # fmt: skip
    lse = torch.empty(b, num_heads, num_partitions, dtype=torch.float32, device=q.device)
    tickets = _tickets(q.device, b * num_kv_heads)
    kernels.attend[(b, num_kv_heads, num_partitions)](
        q, k_cache, v_cache, block_tables, context_lens, out, partial, lse, tickets,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0), partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1), scale, SPLIT=True, NUM_PARTITIONS=num_partitions,
        PARTITIONS_PAD=1 << (num_partitions - 1).bit_length(), **common, num_warps=4,
    )  # fmt: skip
    return out


_TICKETS: dict[torch.device, torch.Tensor] = {}  # per device: [N] int32, zero between launches


def _tickets(device: torch.device, needed: int) -> torch.Tensor:
    """The split kernel's per-(request, KV head) counters, zero between launches (the last
    program of each pair resets its own). Allocated once a device, outside any graph capture:
    a decode graph's warm-up forwards run before its capture with the same shapes."""
    tickets = _TICKETS.get(device)
    if tickets is None or tickets.numel() < needed:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("paged decode: ticket counters must exist before a graph capture")
        tickets = torch.zeros(max(needed, 1 << 14), dtype=torch.int32, device=device)
        _TICKETS[device] = tickets
    return tickets


class _Kernels:
    def __init__(self, attend: Any) -> None:
        self.attend = attend


@functools.cache
def _kernels() -> _Kernels:
    """Define the kernels (Triton is imported here, on the first CUDA decode)."""
    import triton
    import triton.language as tl

    @triton.jit
    def attend(
        q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr, ticket_ptr,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_tb,
        stride_pb, stride_ph, stride_pp, stride_lb, stride_lh,
        scale,
        SPLIT: tl.constexpr, NUM_PARTITIONS: tl.constexpr, PARTITIONS_PAD: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCKS_PER_TILE: tl.constexpr, PARTITION_SIZE: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        # not SPLIT: one partition; out [B, H, D] written in q's dtype.
        # SPLIT: partial [B, H, P, D] (normalized) and lse [B, H, P] written, then the program
        # holding the last ticket of (seq, kv_head) merges them into out.
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
        # out [B, H, D] is contiguous (paged_decode_attention allocates it so)
        out = out_ptr + (seq * (GROUP * tl.num_programs(1)) + heads[:, None]) * HEAD_DIM
        out = out + dims[None, :]
        if SPLIT:
            base = seq * stride_pb + heads * stride_ph
            tl.store(part_ptr + base[:, None] + part * stride_pp + dims[None, :], o,
                     mask=row_ok[:, None])  # fmt: skip
            lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
            lse_row = lse_ptr + seq * stride_lb + heads * stride_lh
            tl.store(lse_row + part, lse, mask=row_ok)
            # Every thread's stores above, then one release: the last ticket sees them all.
            tl.debug_barrier()
            counter = ticket_ptr + seq * tl.num_programs(1) + kv_head
            ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if ticket == NUM_PARTITIONS - 1:  # the last: merge the partitions that hold keys
                parts = tl.arange(0, PARTITIONS_PAD)
                used = (parts < NUM_PARTITIONS) & (parts * PARTITION_SIZE < context)
                for g in tl.static_range(GROUP):  # head by head: each a few parallel loads
                    head = kv_head * GROUP + g
                    # .cg: from L2, where the other programs' stores are (not a stale L1)
                    lse_at = lse_ptr + seq * stride_lb + head * stride_lh + parts
                    lse_g = tl.load(lse_at, mask=used, other=float("-inf"), cache_modifier=".cg")
                    top = tl.max(lse_g, axis=0)
                    top = tl.where(top == float("-inf"), 0.0, top)
                    w = tl.where(used, tl.exp(lse_g - top), 0.0)  # [P]
                    total = tl.sum(w, axis=0)
                    o_g = tl.load(
                        part_ptr + seq * stride_pb + head * stride_ph
                        + parts[:, None] * stride_pp + dims[None, :],
                        mask=used[:, None], other=0.0, cache_modifier=".cg",
                    )  # fmt: skip
                    o_g = tl.sum(o_g * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
                    heads_total = GROUP * tl.num_programs(1)
                    tl.store(out_ptr + (seq * heads_total + head) * HEAD_DIM + dims,
                             o_g.to(out_ptr.dtype.element_ty))  # fmt: skip
                tl.store(counter, 0)  # zero again for the next launch (stream order)
        else:
            tl.store(out, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    return _Kernels(attend)
