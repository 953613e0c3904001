"""The MoE block's experts on a CUDA GPU in Triton, grouped by expert: two launches a layer.

Every (token, k) routing slot is sorted by expert and each expert's run of slots padded to a
whole row block (`sort_by_expert`), so one row block of a grouped GEMM belongs to one expert:

1. `gate_up_kernel`: for each row block x [BM, H] of its expert, gate and up [BN, H] in one
   pass over H (two accumulators), SwiGLU `silu(gate) * up` fused in the epilogue, stored in the
   input dtype at the block's padded rows of `act` [blocks * BM, I].
2. `down_kernel`: act [BM, I] @ down[e].T, times each slot's routing weight, added atomically
   (fp32) into its token's output row: the top-k sum is the epilogue's, no [N, k, H] buffer.

The sort is a dozen small torch ops on the GPU (scatter_add counts, cumsum, argsort, one
scatter), none waits for the host (the plain path's `.tolist()` does), so a whole call can be
captured in a CUDA graph. Experts that get no slot get no block.
The order of the k atomic adds into a token's row is not fixed: results can differ run to run in
the last fp32 bit (the plain path's sum is sequential). fp32 inputs multiply in true fp32
(`input_precision="ieee"`, not TF32): fp32 agrees with the plain path within 1e-4 of the max.

Triton is imported only when it is installed: the CPU machines do not have it, and the CPU path
(layers.py's plain loop) never imports this module at all."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def gate_up_kernel(
        x_ptr, gate_ptr, up_ptr, act_ptr, sorted_slots_ptr, block_expert_ptr,
        hidden, inter, top_k, num_slots,
        stride_xm, stride_we, stride_wn, stride_wk, stride_am,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        block = tl.program_id(0)
        expert = tl.load(block_expert_ptr + block)
        if expert < 0:  # past the blocks the routing used (the grid is sized without a sync)
            return
        rows = block * BM + tl.arange(0, BM)
        slots = tl.load(sorted_slots_ptr + rows)
        valid = slots < num_slots  # padding rows hold num_slots
        tokens = tl.where(valid, slots // top_k, 0)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        a_ptrs = x_ptr + tokens[:, None].to(tl.int64) * stride_xm + ks[None, :]
        w_base = (
            expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
        )
        g_ptrs = gate_ptr + w_base
        u_ptrs = up_ptr + w_base
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        col_ok = cols[None, :] < inter
        for k0 in range(0, hidden, BK):
            k_ok = (ks + k0) < hidden
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok, other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok, other=0.0)
            if IEEE:
                acc_g = tl.dot(a, g, acc_g, input_precision="ieee")
                acc_u = tl.dot(a, u, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(a, g, acc_g)
                acc_u = tl.dot(a, u, acc_u)
            a_ptrs += BK
            g_ptrs += BK * stride_wk
            u_ptrs += BK * stride_wk
        act = acc_g * tl.sigmoid(acc_g) * acc_u
        out_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_am + cols[None, :]
        tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & col_ok)

    @triton.jit
    def down_kernel(
        act_ptr, down_ptr, out_ptr, sorted_slots_ptr, block_expert_ptr, weights_ptr,
        hidden, inter, top_k, num_slots,
        stride_am, stride_we, stride_wn, stride_wk, stride_om,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        block = tl.program_id(0)
        expert = tl.load(block_expert_ptr + block)
        if expert < 0:
            return
        rows = block * BM + tl.arange(0, BM)
        slots = tl.load(sorted_slots_ptr + rows)
        valid = slots < num_slots
        tokens = tl.where(valid, slots // top_k, 0)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)  # over hidden
        ks = tl.arange(0, BK)  # over inter
        a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
        w_ptrs = (
            down_ptr
            + expert.to(tl.int64) * stride_we
            + cols[None, :] * stride_wn
            + ks[:, None] * stride_wk
        )
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        col_ok = cols[None, :] < hidden
        for k0 in range(0, inter, BK):
            k_ok = (ks + k0) < inter
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok, other=0.0)
            if IEEE:  # noqa: SIM108 (a constexpr branch Triton folds away)
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
            a_ptrs += BK
            w_ptrs += BK * stride_wk
        routing = tl.load(weights_ptr + slots, mask=valid, other=0.0).to(tl.float32)
        acc = acc * routing[:, None]
        out_ptrs = out_ptr + tokens[:, None].to(tl.int64) * stride_om + cols[None, :]
        tl.atomic_add(out_ptrs, acc, mask=valid[:, None] & col_ok)


@dataclass(frozen=True)
class Tiles:
    """One launch's tile sizes: BM rows (slots of one expert), BN output columns, BK the
    reduction step; warps and pipeline stages."""

    bm: int
    bn: int
    bk: int
    warps: int
    stages: int


def tiles_for(slots: int, num_experts: int, dtype: torch.dtype) -> tuple[Tiles, Tiles]:
    """(gate_up, down) tiles from the mean slots an expert: decode (a few rows an expert) is
    weight-bandwidth bound, so small row blocks and narrow columns spread the weights over more
    CTAs; prefill gets wider row blocks. fp32 halves the pipeline depth (shared memory)."""
    mean = slots / num_experts
    stages = 2 if dtype == torch.float32 else 3
    if mean <= 16:
        return Tiles(16, 32, 128, 4, stages), Tiles(16, 64, 128, 4, stages)
    if mean <= 64:
        return Tiles(32, 64, 64, 4, stages), Tiles(32, 64, 64, 4, stages)
    return Tiles(64, 64, 64, 4, stages), Tiles(64, 128, 64, 8, stages)


def sort_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [N, k] -> (sorted_slots [blocks * block_m] int32, block_expert [blocks] int32).

    Slot s = token * k + j. Expert e's slots (ascending) fill its padded run of blocks; padding
    rows hold N * k. `blocks` is the bound cdiv(N * k, block_m) + min(E, N * k), so no host sync
    is needed (the shapes depend on N, k, E only: CUDA-graph safe); a block past the used ones
    has expert -1 (the kernels return at once)."""
    flat = topk_ids.flatten().to(torch.int64)
    slots = flat.numel()
    device = flat.device
    # scatter_add, not bincount: CUDA's bincount reads the max back to the host (a sync that
    # also breaks CUDA graph capture); nothing here leaves the GPU
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks_each = (counts + block_m - 1) // block_m
    block_ends = torch.cumsum(blocks_each, 0)
    max_blocks = -(-slots // block_m) + min(num_experts, slots)
    order = torch.argsort(flat, stable=True)
    expert_sorted = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first index in `order`
    rank = torch.arange(slots, device=device) - first[expert_sorted]
    position = (block_ends - blocks_each)[expert_sorted] * block_m + rank
    sorted_slots = torch.full((max_blocks * block_m,), slots, dtype=torch.int32, device=device)
    sorted_slots.scatter_(0, position, order.to(torch.int32))
    block_index = torch.arange(max_blocks, device=device)
    block_expert = torch.searchsorted(block_ends, block_index, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_slots, block_expert


def fused_moe(
    hidden: torch.Tensor,  # [N, H]
    topk_ids: torch.Tensor,  # [N, k] expert indices
    topk_weights: torch.Tensor,  # [N, k] routing weights
    w_gate: torch.Tensor,  # [E, I, H]
    w_up: torch.Tensor,  # [E, I, H]
    w_down: torch.Tensor,  # [E, H, I]
    tiles: tuple[Tiles, Tiles] | None = None,  # (gate_up, down); default `tiles_for`
) -> torch.Tensor:
    """sum_j w[n, j] * down_e(silu(gate_e(x_n)) * up_e(x_n)), e = topk_ids[n, j] -> [N, H].

    gate and up stay two tensors (the checkpoint's, stacked by `stack_experts`): one kernel reads
    both, so no concatenated copy of the experts is ever made."""
    if not HAVE_TRITON:
        raise RuntimeError("fused_moe needs triton (a CUDA machine); the CPU uses the plain path")
    if hidden.dim() != 2 or topk_ids.shape != topk_weights.shape:
        raise ValueError(
            f"fused_moe: hidden [N, H], ids / weights [N, k]; got {tuple(hidden.shape)}, "
            f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}"
        )
    num_experts, inter, size = w_gate.shape
    tokens, top_k = topk_ids.shape
    if size != hidden.shape[1] or w_up.shape != w_gate.shape or w_down.shape != (
        num_experts, size, inter
    ):  # fmt: skip
        raise ValueError(
            f"fused_moe: experts gate {tuple(w_gate.shape)}, up {tuple(w_up.shape)}, down "
            f"{tuple(w_down.shape)} do not fit hidden {tuple(hidden.shape)}"
        )
    out = torch.zeros((tokens, size), dtype=torch.float32, device=hidden.device)
    if tokens == 0:
        return out.to(hidden.dtype)
    hidden = hidden.contiguous()
    w_gate, w_up, w_down = w_gate.contiguous(), w_up.contiguous(), w_down.contiguous()
    slots = tokens * top_k
    ieee = hidden.dtype == torch.float32
    first, second = tiles or tiles_for(slots, num_experts, hidden.dtype)
    if first.bm != second.bm:
        raise ValueError(f"fused_moe: both launches share the sort's row block; got {tiles}")
    sorted_slots, block_expert = sort_by_expert(topk_ids, num_experts, first.bm)
    blocks = block_expert.numel()
    act = torch.empty((blocks * first.bm, inter), dtype=hidden.dtype, device=hidden.device)
    gate_up_kernel[(blocks, triton.cdiv(inter, first.bn))](
        hidden, w_gate, w_up, act, sorted_slots, block_expert,
        size, inter, top_k, slots,
        hidden.stride(0), w_gate.stride(0), w_gate.stride(1), w_gate.stride(2), act.stride(0),
        BM=first.bm, BN=first.bn, BK=first.bk, IEEE=ieee,
        num_warps=first.warps, num_stages=first.stages,
    )  # fmt: skip
    weights = topk_weights.contiguous().flatten()
    down_kernel[(blocks, triton.cdiv(size, second.bn))](
        act, w_down, out, sorted_slots, block_expert, weights,
        size, inter, top_k, slots,
        act.stride(0), w_down.stride(0), w_down.stride(1), w_down.stride(2), out.stride(0),
        BM=first.bm, BN=second.bn, BK=second.bk, IEEE=ieee,
        num_warps=second.warps, num_stages=second.stages,
    )  # fmt: skip
    return out if hidden.dtype == torch.float32 else out.to(hidden.dtype)
