"""Fused CUDA kernels of the step (Triton): fewer launches in a launch-bound decode graph.

A decode step of a small model is one graph of ~25 kernels a layer, each a few microseconds
(docs/engine.md has the profile). Two groups of them are elementwise work that one kernel does:

  rms_norm   bf16/fp16: cast to float32, normalize, cast back, scale by the weight (4 kernels)
             -> 1, with the same roundings (normalized in float32, rounded to the model dtype,
             then the weight's product rounded), so the numbers are torch's to the last bit
             up to the order of the mean's sum
  add_rms_norm  the residual add before a norm (h = h + delta, rounded to the model dtype as
             torch's add rounds) and the norm of the sum, in the same kernel: one launch fewer
             per add (two a layer), the sum read once
  rope_kv    RoPE of Q and K (cast, complex multiply, cast back) and the K/V cache writes
             (two index_copy_) -> 1: reads the fused QKV row once, writes the rotated Q and
             puts the rotated K and V into their cache slots
  silu_mul   SwiGLU's silu(gate) * up (2 kernels) -> 1, rounded as the two ops round
  greedy_tokens  each row's argmax in two stages: chunks of the vocabulary in parallel, then
             one program a row over the chunks' maxima (torch's argmax over 128k logits runs
             one block a row: 27 us on the H200); the first index of the maximum, as torch's

Used on CUDA where Triton imports (`paged_decode.available()`); the CPU keeps torch's ops.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [T, C]
    """x's rows may be strided (a head's columns of a fused projection, x.stride(1) == 1); the
    output is contiguous [T, C]. (Writing the output at x's row stride overran it: a one-KV-head
    model's k_norm input is such a view; docs/gpu.md.)"""
    kernel = _kernels()["rms_norm"]
    rows, width = x.shape
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    block = 1 << (width - 1).bit_length()
    kernel[(rows,)](x, weight, out, x.stride(0), width, eps, BLOCK=block, num_warps=4)
    return out


def add_rms_norm(
    delta: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:  # [T, C] each -> (h + delta, rms_norm(h + delta))
    kernel = _kernels()["add_rms_norm"]
    rows, width = h.shape
    # contiguous outputs (the kernel writes row * width), whatever h's strides
    total = torch.empty((rows, width), dtype=h.dtype, device=h.device)
    out = torch.empty((rows, width), dtype=h.dtype, device=h.device)
    block = 1 << (width - 1).bit_length()
    kernel[(rows,)](
        delta, h, weight, total, out, delta.stride(0), h.stride(0), width, eps,
        BLOCK=block, num_warps=4,
    )  # fmt: skip
    return total, out


def rope_kv(
    qkv: torch.Tensor,  # [T, (H + 2 Hkv) D] the fused projection
    rope: torch.Tensor,  # [T, 1, D/2] complex64: each token's rotation
    slots: torch.Tensor,  # [T] int64: where each token's K/V goes
    k_cache: torch.Tensor,  # [S, Hkv, D]
    v_cache: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:  # [T, H, D] rotated queries
    kernel = _kernels()["rope_kv"]
    tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    table = torch.view_as_real(rope)  # [T, 1, D/2, 2] float32: cos, sin
    kernel[(tokens, num_heads + 2 * num_kv_heads)](
        qkv, table, slots, q, k_cache, v_cache,
        qkv.stride(0), table.stride(0), k_cache.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2, num_warps=1,
    )  # fmt: skip
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    kernel = _kernels()["silu_mul"]
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, width, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    kernel[(tokens, -(-width // block))](gate_up, out, width, gate_up.stride(0), BLOCK=block)
    return out


ARGMAX_CHUNK = 2048  # logits per program of the first stage


def greedy_tokens(logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[r] = argmax(logits[r]) (the first maximum), [R, V] float32 -> out [R] int64.
    NaN-free logits (a NaN row's answer is unspecified here; torch's would be the NaN's index).
    Where Triton is absent, or the vocabulary is one chunk, torch.argmax into `out`."""
    from omni_server.engine.paged_decode import available

    rows, vocab = logits.shape
    if not (logits.is_cuda and available()) or vocab <= ARGMAX_CHUNK or logits.stride(1) != 1:
        return torch.argmax(logits, dim=-1, out=out)
    kernels = _kernels()
    chunks = -(-vocab // ARGMAX_CHUNK)
    best = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    where = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
    kernels["argmax_chunks"][(rows, chunks)](
        logits, best, where, vocab, logits.stride(0), chunks, BLOCK=ARGMAX_CHUNK, num_warps=4
    )
    block = 1 << (chunks - 1).bit_length()
    kernels["argmax_rows"][(rows,)](best, where, out, chunks, BLOCK=block, num_warps=1)
    return out


@functools.cache
def _kernels() -> dict[str, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride, width, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < width
        x = tl.load(x_ptr + row * stride + cols, mask=ok, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / width
        normed = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)  # torch's .to(dtype)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        y = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * width + cols, y, mask=ok)  # out is contiguous

    @triton.jit
    def add_rms_norm_kernel(
        d_ptr, h_ptr, w_ptr, total_ptr, out_ptr, stride_d, stride_h, width, eps,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        # total = h + delta rounded to the model dtype (torch's bf16 add: float32 sum, one
        # rounding); the norm then reads the rounded sum, as the unfused ops do
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < width
        d = tl.load(d_ptr + row * stride_d + cols, mask=ok, other=0.0)
        h = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0)
        s = (h.to(tl.float32) + d.to(tl.float32)).to(total_ptr.dtype.element_ty)
        tl.store(total_ptr + row * width + cols, s, mask=ok)
        x = s.to(tl.float32)
        var = tl.sum(x * x, axis=0) / width
        normed = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        y = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * width + cols, y, mask=ok)

    @triton.jit
    def rope_kv_kernel(
        qkv_ptr, table_ptr, slot_ptr, q_ptr, k_ptr, v_ptr,
        stride_t, stride_p, stride_s,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    ):  # fmt: skip
        # One program per (token, head row): rows 0..H-1 are Q, H..H+Hkv-1 K, then V.
        t = tl.program_id(0)
        head = tl.program_id(1)
        pairs = tl.arange(0, HALF)
        row = qkv_ptr + t * stride_t + head * (2 * HALF) + 2 * pairs
        a = tl.load(row)
        b = tl.load(row + 1)
        if head < NUM_HEADS + NUM_KV_HEADS:  # Q and K rotate; V passes through
            cos = tl.load(table_ptr + t * stride_p + 2 * pairs)
            sin = tl.load(table_ptr + t * stride_p + 2 * pairs + 1)
            af, bf = a.to(tl.float32), b.to(tl.float32)
            ra = (af * cos - bf * sin).to(a.dtype)
            rb = (af * sin + bf * cos).to(a.dtype)
            if head < NUM_HEADS:
                q_off = q_ptr + (t * NUM_HEADS + head) * (2 * HALF) + 2 * pairs
                tl.store(q_off, ra)
                tl.store(q_off + 1, rb)
            else:
                slot = tl.load(slot_ptr + t)
                k_off = k_ptr + slot * stride_s + (head - NUM_HEADS) * (2 * HALF) + 2 * pairs
                tl.store(k_off, ra)
                tl.store(k_off + 1, rb)
        else:
            slot = tl.load(slot_ptr + t)
            kv_head = head - NUM_HEADS - NUM_KV_HEADS
            v_off = v_ptr + slot * stride_s + kv_head * (2 * HALF) + 2 * pairs
            tl.store(v_off, a)
            tl.store(v_off + 1, b)

    @triton.jit
    def silu_mul_kernel(x_ptr, out_ptr, width, stride_x, BLOCK: tl.constexpr):
        # x [T, 2I] = gate | up -> out [T, I] = silu(gate) * up, rounded as torch's two ops
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        up = tl.load(x_ptr + row * stride_x + width + cols, mask=ok, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # F.silu, rounded to the model dtype
        y = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
        tl.store(out_ptr + row * width + cols, y, mask=ok)

    @triton.jit
    def argmax_chunks_kernel(
        x_ptr, best_ptr, where_ptr, vocab, stride, chunks, BLOCK: tl.constexpr
    ):  # fmt: skip
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride + cols, mask=cols < vocab, other=-float("inf"))
        value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(best_ptr + row * chunks + chunk, value)
        tl.store(where_ptr + row * chunks + chunk, chunk * BLOCK + index.to(tl.int64))

    @triton.jit
    def argmax_rows_kernel(best_ptr, where_ptr, out_ptr, chunks, BLOCK: tl.constexpr):
        # the largest chunk maximum; among equal ones the first chunk (so the first index)
        row = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        ok = i < chunks
        best = tl.load(best_ptr + row * chunks + i, mask=ok, other=-float("inf"))
        _, first = tl.max(best, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(out_ptr + row, tl.load(where_ptr + row * chunks + first))

    return {
        "argmax_chunks": argmax_chunks_kernel,
        "argmax_rows": argmax_rows_kernel,
        "rms_norm": rms_norm_kernel,
        "add_rms_norm": add_rms_norm_kernel,
        "rope_kv": rope_kv_kernel,
        "silu_mul": silu_mul_kernel,
    }
