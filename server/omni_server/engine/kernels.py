"""The kernels a decoder's layers run, chosen once for the device a model is placed on.

A model asks `kernels_for(device)` when it is placed (Llama.place / Llama.adopt) and its layers
call that one object: no layer checks the device or whether Triton imports. Three backends,
each the numbers the layers had when they chose per call:

  CpuKernels     the CPU: float32 RMSNorm without F.rms_norm's casts and checks, the residual
                 add inside the row-parallel matmul (addmm); bf16 / fp16 as TorchKernels
  TorchKernels   torch ops alone (CUDA without Triton): the reference roundings
  TritonKernels  CUDA with Triton: fused.py's RMSNorm, add + RMSNorm, RoPE + cache writes and
                 SwiGLU, gemv.py's few-row matmuls; bf16 / fp16 defer each residual add to the
                 norm after it (DecoderLayer.forward_deferred)

Decode attention's form (gathered, one span, paged) is data, not a kernel choice here: the
runner picks it once (EngineConfig.decode_attention) and the step's DecodeGroup carries it
(attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omni_server.engine import fused, gemv
from omni_server.engine.paged_decode import available as triton_available
from omni_server.engine.parallel import TensorParallel


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) as complex numbers. x [T, N, D]; rope [T, 1, D/2]."""
    t, n, d = x.shape
    single = x.dtype == torch.float32  # no cast calls then: each costs a call after a matmul
    pairs = torch.view_as_complex((x if single else x.float()).view(t, n, d // 2, 2))
    out = torch.view_as_real(pairs * rope).view(t, n, d)  # [T, N, D/2] complex, as real pairs
    return out if single else out.to(x.dtype)


class TorchKernels:
    """torch ops alone: what every other backend falls back to."""

    def defers_adds(self, h: torch.Tensor) -> bool:
        """Whether a forward over `h` runs the deferred-add layers (forward_deferred)."""
        return False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)  # one fused kernel
        # Normalize in float32, then scale in the model dtype, as transformers does.
        return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)

    def add_rms_norm(
        self, delta: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, norm(h + delta)): torch's add, then this backend's norm."""
        h = h + delta
        return h, self.rms_norm(h, weight, eps)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """F.linear(x, weight), then cast to out_dtype."""
        out = F.linear(x, weight)
        return out if out_dtype is None else out.to(out_dtype)

    def project(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        tp: TensorParallel,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        """x @ weight.T summed over the ranks (a row-parallel matmul), plus `residual` if given.
        The add stays its own op: bf16 rounds the product first as transformers does, and under
        TP the residual must not be summed over the ranks."""
        if residual is None:
            return tp.all_reduce(self.linear(x, weight))
        return residual + tp.all_reduce(self.linear(x, weight))

    def rope_and_cache(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 Hkv) D]
        rope: torch.Tensor,  # [T, 1, D/2] complex64
        slot_mapping: torch.Tensor,  # [T] int64
        k_cache: torch.Tensor,  # [S, Hkv, D]
        v_cache: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor:  # [T, H, D] the rotated queries
        """RoPE on Q and K, and K / V written to their cache slots (write first: each token
        then attends to itself through the cache like any other key)."""
        t = qkv.shape[0]
        num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        # Q and K heads rotated in one call: [T, H + Hkv, D]
        qk = apply_rope(qkv[:, : q_size + kv_size].view(t, -1, head_dim), rope)
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        v = qkv[:, q_size + kv_size :]
        k_cache.index_copy_(0, slot_mapping, k)
        v_cache.index_copy_(0, slot_mapping, v.view(t, num_kv_heads, head_dim))
        return q

    def swiglu_down(
        self,
        gate_up: torch.Tensor,  # [T, 2I]
        w_down: torch.Tensor,  # [C, I] (this rank's columns)
        tp: TensorParallel,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:  # [T, C]
        """silu(gate) * up, projected down and summed over the ranks (+ residual)."""
        intermediate = gate_up.shape[1] // 2
        gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]  # [T, I]
        # in place into silu's output: one tensor fewer, rounded as silu(gate) * up
        return self.project(F.silu(gate).mul_(up), w_down, tp, residual)


class CpuKernels(TorchKernels):
    """The CPU: float32 without casts; bf16 / fp16 as TorchKernels."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:
            # F.rms_norm's own arithmetic (it is a composite on the CPU), without its casts
            # and checks, two of its tensors reused in place: bitwise the same, a third less
            # time after a matmul has flushed the caches (every call in a decode step)
            scale = torch.mean(x * x, dim=-1, keepdim=True).add_(eps).rsqrt_()
            return torch.mul(x, scale).mul_(weight)
        return super().rms_norm(x, weight, eps)

    def project(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        tp: TensorParallel,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        """One rank in float32: the residual add rides in the matmul (addmm, beta = 1), one op
        and one tensor fewer, the same numbers at decode sizes."""
        if residual is not None and tp.size == 1 and x.dtype == torch.float32:
            return torch.addmm(residual, x, weight.t())
        return super().project(x, weight, tp, residual)


class TritonKernels(TorchKernels):
    """CUDA with Triton: fused.py and gemv.py where they take the dtype (bf16 / fp16; float32
    keeps torch's RMSNorm and matmuls but the fused RoPE and SwiGLU)."""

    def defers_adds(self, h: torch.Tensor) -> bool:
        # fused.add_rms_norm's roundings are torch's in bf16 / fp16; float32 keeps the plain
        # layers
        return h.dtype != torch.float32

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != torch.float32 and x.stride(-1) == 1:
            return fused.rms_norm(x, weight, eps)  # the 4 kernels of the torch path in one
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(
        self, delta: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.defers_adds(h):
            return fused.add_rms_norm(delta, h, weight, eps)
        return super().add_rms_norm(delta, h, weight, eps)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """gemv.linear in bf16 / fp16: its kernel for the few-row matmuls it is faster at."""
        if x.dtype != torch.float32:
            return gemv.linear(x, weight, out_dtype)
        return super().linear(x, weight, out_dtype)

    def rope_and_cache(
        self,
        qkv: torch.Tensor,
        rope: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor:
        # RoPE and both cache writes in one kernel
        return fused.rope_kv(qkv, rope, slot_mapping, k_cache, v_cache, num_heads)

    def swiglu_down(
        self,
        gate_up: torch.Tensor,
        w_down: torch.Tensor,
        tp: TensorParallel,
        residual: torch.Tensor | None,
    ) -> torch.Tensor:
        # bf16 / fp16: the activation inside the few-row matmul, where it takes this one
        down = None if gate_up.dtype == torch.float32 else gemv.silu_mul_linear(gate_up, w_down)
        if down is not None:  # project()'s sum over the ranks and residual add
            down = tp.all_reduce(down)
            return down if residual is None else residual + down
        return self.project(fused.silu_mul(gate_up), w_down, tp, residual)


Kernels = TorchKernels  # the interface: every backend is one

CPU = CpuKernels()


def kernels_for(device: torch.device | str) -> TorchKernels:
    """The backend of a model placed on `device`."""
    kind = torch.device(device).type
    if kind == "cpu":
        return CPU
    if kind == "cuda" and triton_available():
        return TritonKernels()
    return TorchKernels()
