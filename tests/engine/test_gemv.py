"""The few-row matmul (gemv.py) and the two-stage argmax (fused.greedy_tokens) against torch on
a GPU (marked gpu); which matmuls take the kernel, here (pure arithmetic on shapes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omni_server.engine import gemv
from omni_server.engine.gemv import Config, config_for


def test_config_covers_the_decode_matmuls_it_should() -> None:
    assert config_for(1, 2048, 8192) is not None  # the 1.2B's down projection at one row
    assert config_for(1, 16384, 2048) is None  # gate/up: cuBLAS reads it faster
    assert config_for(gemv.MAX_ROWS + 1, 2048, 8192) is None  # more rows: cuBLAS
    assert config_for(1, 2048, 1000) is None  # K not a multiple of the block
    for m in range(1, gemv.MAX_ROWS + 1):  # every configuration divides its K
        for n, k in ((3072, 2048), (16384, 2048), (2048, 8192), (5120, 3072)):
            c = config_for(m, n, k)
            if c is not None:
                assert k % c.block_k == 0 and c.block_n >= 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize(("n", "k"), [(2048, 8192), (1000, 512), (5120, 3072)])
def test_gemv_equals_torch(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(m * n + k)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    ref = x.double() @ w.double().T
    torch_err = ((F.linear(x, w).double() - ref).norm() / ref.norm()).item()
    for config in {Config(4, 512, 4, 4), config_for(m, n, k)}:
        if config is None:
            continue
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        out.copy_(gemv.matmul(x, w, config))
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err <= max(2 * torch_err, 1e-2), (config, err, torch_err)  # NaN fails
        as_float = gemv.matmul(x, w, config, torch.float32)  # the head's float32 logits
        assert as_float.dtype == torch.float32 and torch.equal(as_float, out.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2])
def test_silu_mul_inside_the_matmul_equals_the_two_kernels(dtype: torch.dtype, m: int) -> None:
    from omni_server.engine import fused

    gen = torch.Generator(device="cuda").manual_seed(m)
    gate_up = (torch.randn(m, 2 * 8192, device="cuda", generator=gen) * 2).to(dtype)
    w = (torch.randn(2048, 8192, device="cuda", generator=gen) / 8192**0.5).to(dtype)
    config = config_for(m, 2048, 8192)
    assert config is not None
    out = torch.full((m, 2048), float("nan"), dtype=dtype, device="cuda")
    out.copy_(gemv.silu_mul_linear(gate_up, w))
    act = fused.silu_mul(gate_up)  # the unfused pair: the same input rounding
    assert torch.equal(out, gemv.matmul(act, w, config))  # the same kernel's sum order
    ref = act.double() @ w.double().T
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err <= 1e-2, err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("rows", "vocab"), [(1, 128256), (4, 49152), (3, 5000), (2, 1000)])
def test_two_stage_argmax_equals_torch(rows: int, vocab: int) -> None:
    from omni_server.engine import fused

    gen = torch.Generator(device="cuda").manual_seed(vocab)
    for _ in range(3):  # fresh logits each time
        logits = torch.randn(rows, vocab, device="cuda", generator=gen) * 4
        top = logits.max() + 1
        logits[0, vocab // 3] = logits[0, vocab - 7] = top  # a tie across chunks: the first
        logits[-1, 5] = logits[-1, 6] = top  # a tie inside one chunk
        out = torch.full((rows,), -5, dtype=torch.int64, device="cuda")
        fused.greedy_tokens(logits, out)
        assert torch.equal(out, logits.argmax(dim=-1)), (out, logits.argmax(dim=-1))
