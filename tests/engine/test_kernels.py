"""The kernel backend (engine/kernels.py): chosen once when a model is placed, and the torch
backend (what CUDA without Triton runs) giving the CPU backend's numbers, run here on the CPU.
The Triton backend is GPU-only: tests/engine/test_paged_decode.py (`-m gpu`) holds it to torch."""

from __future__ import annotations

import torch

from omni_server.engine.attention import ForwardBatch, PrefillChunk
from omni_server.engine.families.llama.model import Llama
from omni_server.engine.kernels import CPU, CpuKernels, TorchKernels, kernels_for
from omni_server.engine.kv_cache import KVCache
from tests.engine.conftest import TINY


def _logits(model: Llama, ids: list[int]) -> torch.Tensor:
    cache = KVCache(model.local_shape, 64, 16, torch.float32, torch.device("cpu"))
    n = len(ids)
    slots = torch.arange(16, 16 + n)  # block 1 (block 0 is the scratch block)
    batch = ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=torch.arange(n),
        slot_mapping=slots,
        logits_indices=torch.arange(n),
        decode=None,
        prefills=[PrefillChunk(0, n, slots)],  # one prompt from position 0: causal
    )
    with torch.inference_mode():
        return model.forward(batch, cache.k, cache.v)


def test_a_placed_model_calls_one_backend_in_every_module() -> None:
    assert kernels_for("cpu") is CPU and isinstance(CPU, CpuKernels)
    model = Llama(TINY, max_positions=64).place("cpu", torch.float32)
    with_kernels = [m for m in model.modules() if hasattr(m, "kernels")]
    assert len(with_kernels) == 1 + TINY.num_layers * 4 + 1  # model, 2 norms + attn + mlp, norm
    assert all(m.kernels is CPU for m in with_kernels)
    torch_kernels = TorchKernels()
    model.use_kernels(torch_kernels)
    assert all(m.kernels is torch_kernels for m in with_kernels)


def test_torch_backend_equals_the_cpu_backend() -> None:
    """RMSNorm bit for bit; the residual add outside the matmul (torch) or inside it (CPU
    addmm) within float32 rounding; the same greedy tokens."""
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    weight = torch.rand(64) + 0.5
    assert torch.equal(TorchKernels().rms_norm(x, weight, 1e-5), CPU.rms_norm(x, weight, 1e-5))
    model = Llama(TINY, max_positions=64).place("cpu", torch.float32)
    model.init_random(seed=2)
    ids = [3, 17, 90, 4, 55, 8, 1]
    cpu = _logits(model, ids)
    model.use_kernels(TorchKernels())
    torch_ = _logits(model, ids)
    torch.testing.assert_close(torch_, cpu, rtol=1e-5, atol=1e-5)
    assert torch.equal(torch_.argmax(-1), cpu.argmax(-1))
