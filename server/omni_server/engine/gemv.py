"""A matmul of a few rows (decode steps of 1-2 requests) near the weights' read speed (Triton).

At one row, x [M, K] @ W.T with W [N, K] is a read of W: its bytes over HBM bandwidth are the
floor (a 2048 x 8192 bf16 weight: 32 MiB, 7 us at 4.8 TB/s). cuBLAS's kernels for it reach
1.3-2.7 TB/s on the H200 at the engine's narrower weights (docs/engine.md); this kernel gives each
program BLOCK_N whole rows of W (no split over K, so no second pass and the same sum order on
every run) and keeps a [M, BLOCK_N, BLOCK_K] float32 partial sum per thread, reduced once at
the end: each iteration is a wide coalesced read of W and multiply-adds, nothing else.
`silu_mul_linear` also computes SwiGLU's activation as it reads the down projection's input.

Numbers: float32 accumulation, rounded once to the model dtype, as torch's bf16 / fp16 matmul
rounds (the sum order differs, so results agree to the dtype's rounding, not bit for bit).
`linear` uses it where `config_for` has a configuration for the (M, N, K) (measured faster
than cuBLAS on the H200: tools/device/gemv_bench.py), and F.linear elsewhere; the CPU never
comes here (families/llama/model.py calls it only on CUDA with Triton).
"""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

MAX_ROWS = 2  # the largest M it takes: at 4 rows cuBLAS was faster at every shape measured


class Config(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def config_for(m: int, n: int, k: int) -> Config | None:
    """The kernel's configuration for x [m, k] @ W[n, k].T, or None: cuBLAS is the faster.

    From tools/device/gemv_bench.py on the H200 (2026-12-02, docs/engine.md): one row, up to
    4096 outputs (QKV, the attention output, the down projection of the 135M-3B shapes) 1.1-1.8x
    faster than cuBLAS's gemv; two rows only up to 2048 outputs. Wide weights (gate/up, the
    vocabulary head: 16k-128k rows) cuBLAS reads at 3.7-4.3 TB/s, which this kernel does not
    beat; tiny ones (under 512k weights) are launch-bound either way."""
    if m > MAX_ROWS or n > (4096 if m == 1 else 2048) or k % 512 or n * k < 1 << 19:
        return None
    block_k = 1024 if k % (1024 * m) == 0 else 512
    return Config(4, block_k, 4, 4)


def enabled() -> bool:
    """OMNI_GEMV=0 turns the kernel off (a peer to measure against in the same run)."""
    return os.environ.get("OMNI_GEMV", "1") != "0"


def linear(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T, rounded to x's dtype, then cast to out_dtype if given
    (F.linear(x, weight).to(out_dtype))."""
    m, k = x.shape
    n = weight.shape[0]
    config = config_for(m, n, k) if _ENABLED else None
    if config is None or x.stride(1) != 1 or weight.stride(1) != 1:
        out = F.linear(x, weight)
        return out if out_dtype is None else out.to(out_dtype)
    return matmul(x, weight, config, out_dtype)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """(silu(gate) * up) @ weight.T for gate_up [M, 2K] = gate | up (SwiGLU's down projection)
    with the activation computed as the kernel reads its input, rounded as fused.silu_mul
    rounds: one kernel instead of two. None where config_for gives the matmul to cuBLAS."""
    m, k = gate_up.shape[0], gate_up.shape[1] // 2
    config = config_for(m, weight.shape[0], k) if _ENABLED else None
    if config is None or gate_up.stride(1) != 1 or weight.stride(1) != 1:
        return None
    return matmul(gate_up, weight, config, gated=True)


def matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: Config,
    out_dtype: torch.dtype | None = None,
    gated: bool = False,  # x is [M, 2K] gate | up: the input is silu(gate) * up
) -> torch.Tensor:
    """The kernel at a given configuration (the bench times several)."""
    m, k = x.shape[0], x.shape[1] // 2 if gated else x.shape[1]
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    block_m = 1 << (m - 1).bit_length()
    grid = (-(-n // config.block_n),)
    _kernel()[grid](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GATED=gated,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


_ENABLED = enabled()


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(
        x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GATED: tl.constexpr,
    ):  # fmt: skip
        # One program: rows [n0, n0 + BLOCK_N) of W against all M rows of x, over all of K
        # (K a multiple of BLOCK_K: config_for). The partial sums stay elementwise until the end.
        # GATED: x_ptr is SwiGLU's [M, 2K] gate | up and the input row is silu(gate) * up.
        n0 = tl.program_id(0) * BLOCK_N
        rn = n0 + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        m_ok = rm < M
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]  # [BN, BK]
        x_rows = x_ptr + rm[:, None] * stride_xm + rk[None, :]  # [BM, BK]
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            w = tl.load(w_rows + k0, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_rows + k0, mask=m_ok[:, None], other=0.0)
            if GATED:  # x is the gate; up is K further on. fused.silu_mul's roundings
                up = tl.load(x_rows + k0 + K, mask=m_ok[:, None], other=0.0)
                g = x.to(tl.float32)
                act = (g / (1.0 + tl.exp(-g))).to(x.dtype)
                x = (act.to(tl.float32) * up.to(tl.float32)).to(up.dtype)
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        total = tl.sum(acc, axis=2)  # [BM, BN]
        y = total.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)  # F.linear's rounding
        out = out_ptr + rm[:, None] * stride_om + rn[None, :]
        tl.store(out, y, mask=m_ok[:, None] & n_ok[None, :])

    return gemv_kernel
