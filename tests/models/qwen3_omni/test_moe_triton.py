"""moe_triton's fused experts equal the plain per-expert loop (layers.Experts with `fused` None)
on a CUDA GPU, at the full thinker's and talker's expert shapes, fp32 and bf16, for 1, 7, 64 and
512 tokens (with 1 and 7 tokens most experts get no slot; `test_skewed_routing...` routes
everything to a few experts). SparseMoE picks the kernel when moved to CUDA; on the CPU the
plain path runs and neither moe_triton nor triton is imported. The sort by expert that both
launches read is plain torch and is checked on the CPU too."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
import textwrap

import pytest
import torch

from omni_server.models.qwen3_omni.config import DecoderShape
from omni_server.models.qwen3_omni.layers import Experts, SparseMoE
from omni_server.models.qwen3_omni.moe_triton import sort_by_expert

ON_GPU = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU and triton")

# (hidden, expert intermediate, experts, top-k) of Qwen3-Omni-30B-A3B's thinker and talker
SHAPES = {"thinker": (2048, 768, 128, 8), "talker": (1024, 384, 128, 6)}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # of the output's largest magnitude


@functools.cache
def random_experts(name: str, dtype: torch.dtype) -> Experts:
    """One set of random experts a shape and dtype, drawn on the GPU (1/sqrt(fan_in) scale)."""
    hidden, inter, count, _ = SHAPES[name]
    experts = Experts(count, hidden, inter).to("cuda", dtype)
    generator = torch.Generator("cuda").manual_seed(0)
    with torch.no_grad():
        for weight in (experts.gate_proj, experts.up_proj, experts.down_proj):
            weight.normal_(0, weight.shape[-1] ** -0.5, generator=generator)
    return experts


def routing(tokens: int, count: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct experts a token and softmax weights summing to 1, on the GPU."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, count, generator=generator)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return ids.cuda(), (weights / weights.sum(-1, keepdim=True)).cuda()


@torch.no_grad()
def plain_and_fused(
    experts: Experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    fused = experts.fused
    assert fused is not None, "Experts on CUDA did not pick the fused kernel"
    experts.fused = None
    try:
        plain = experts(x, ids, weights)
    finally:
        experts.fused = fused
    return plain, experts(x, ids, weights)


@functools.cache
def fp32_oracle(name: str) -> Experts:
    """The bf16 experts' own values in fp32: the reference both bf16 paths are held to."""
    bf16 = random_experts(name, torch.bfloat16)
    hidden, inter, count, _ = SHAPES[name]
    oracle = Experts(count, hidden, inter).to("cuda")
    with torch.no_grad():
        for mine, theirs in zip(oracle.parameters(), bf16.parameters(), strict=True):
            mine.copy_(theirs.float())
    oracle.fused = None
    return oracle


def max_error(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Largest absolute difference, as a fraction of the reference's largest magnitude."""
    assert other.shape == reference.shape
    scale = reference.float().abs().max().item()
    assert scale > 0
    return (other.float() - reference.float()).abs().max().item() / scale


def assert_close(plain: torch.Tensor, fused: torch.Tensor, dtype: torch.dtype) -> None:
    assert fused.dtype == plain.dtype
    error = max_error(plain, fused)
    assert error <= TOLERANCE[dtype], f"fused vs plain: max error {error:.2e} of the max"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 7, 64, 512])
@pytest.mark.gpu
@needs_gpu
def test_fused_experts_equal_the_plain_loop(tokens: int, name: str, dtype: torch.dtype) -> None:
    experts = random_experts(name, dtype)
    hidden, _, count, top_k = SHAPES[name]
    ids, weights = routing(tokens, count, top_k, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    if tokens <= 7:
        assert ids.unique().numel() < count  # experts with no slot at all
    plain, fused = plain_and_fused(experts, x, ids, weights.to(dtype))
    if dtype == torch.float32:
        assert_close(plain, fused, dtype)
        return
    # bf16: the plain path rounds gate, up, their product, each expert's output and the running
    # sum to bf16, so it sits ~1e-2 of the max from the truth itself; the kernel (fp32 within a
    # launch) is held to 1e-2 of the fp32 oracle on the same bf16 values, and to 2e-2 of plain
    with torch.no_grad():
        oracle = fp32_oracle(name)(x.float(), ids, weights.to(dtype).float())
    assert max_error(oracle, fused) <= 1e-2, max_error(oracle, fused)
    assert max_error(plain, fused) <= 2e-2, max_error(plain, fused)


@pytest.mark.gpu
@needs_gpu
def test_skewed_routing_with_idle_experts_equals_the_plain_loop() -> None:
    """300 tokens on 3 of 128 experts (one of them takes every token: many row blocks of one
    expert, 125 experts idle), bf16."""
    experts = random_experts("thinker", torch.bfloat16)
    tokens = 300
    ids = torch.tensor([[5, 77, 127]] * tokens)
    ids[::2, 1] = 0  # expert 0 and 77 share the second slot
    weights = torch.softmax(torch.randn(tokens, 3), -1)
    x = torch.randn(tokens, 2048)
    plain, fused = plain_and_fused(
        experts, x.to("cuda", torch.bfloat16), ids.cuda(), weights.to("cuda", torch.bfloat16)
    )
    assert max_error(plain, fused) <= 2e-2


@pytest.mark.gpu
@needs_gpu
def test_fused_experts_replay_in_a_cuda_graph() -> None:
    """No host sync inside fused_moe: captured once, a replay on new tokens and new routing
    gives what an eager call gives (the engine runs its decode steps as graphs)."""
    experts = random_experts("thinker", torch.bfloat16)
    ids, weights = routing(16, 128, 8, seed=5)
    x = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)
    weights = weights.to(torch.bfloat16)
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            experts(x, ids, weights)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = experts(x, ids, weights)
        new_ids, new_weights = routing(16, 128, 8, seed=6)
        x.copy_(torch.randn_like(x))
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        eager = experts(x, ids, weights)
    assert max_error(eager, out) <= 1e-2  # a bf16 ulp: the atomic adds' order may differ


@pytest.mark.gpu
@needs_gpu
def test_sparse_moe_with_shared_expert_uses_the_kernel_on_cuda() -> None:
    """The talker's block (routed experts + sigmoid-gated shared expert), built on the CPU and
    moved: its experts pick the kernel, and the block's output equals the plain path's."""
    shape = DecoderShape(
        vocab_size=8, hidden_size=1024, intermediate_size=2048, num_layers=1, num_heads=8,
        num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, mrope_section=None,
        num_experts=128, top_k=6, moe_intermediate_size=384, shared_expert_size=768,
    )  # fmt: skip
    torch.manual_seed(3)
    block = SparseMoE(shape)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, param.shape[-1] ** -0.5)
    assert block.experts.fused is None  # on the CPU
    block = block.to("cuda", torch.float32)
    assert block.experts.fused is not None
    x = torch.randn(2, 9, 1024, device="cuda")
    with torch.no_grad():
        fused = block(x)
        block.experts.fused = None
        plain = block(x)
    assert_close(plain, fused, torch.float32)


@pytest.mark.parametrize(
    ("tokens", "top_k", "count", "block"),
    [(1, 8, 128, 16), (7, 8, 128, 16), (64, 8, 128, 32), (300, 3, 128, 64), (5, 2, 4, 16)],
)
def test_sort_by_expert_gives_each_slot_one_row_of_its_experts_blocks(
    tokens: int, top_k: int, count: int, block: int
) -> None:
    """Every (token, k) slot lands exactly once, in a block of its own expert, each expert's
    slots ascending; padding rows hold N * k; blocks past the used ones have expert -1 and
    only padding; the grid bound holds whatever the routing (here expert 5 takes every token
    when tokens = 300)."""
    generator = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(count, generator=generator)[:top_k] for _ in range(tokens)])
    if tokens == 300:
        ids[:, 0] = 5
        ids[:, 1:] = torch.where(ids[:, 1:] == 5, 6, ids[:, 1:])
    slots = tokens * top_k
    sorted_slots, block_expert = sort_by_expert(ids, count, block)
    assert sorted_slots.numel() == block_expert.numel() * block
    seen: list[int] = []
    for index, expert in enumerate(block_expert.tolist()):
        rows = sorted_slots[index * block : (index + 1) * block]
        real = rows[rows < slots]
        if expert < 0:
            assert real.numel() == 0
            continue
        assert real.numel() > 0  # no block of an expert that got nothing
        assert (ids.flatten()[real.long()] == expert).all()
        assert (rows[real.numel() :] == slots).all()  # padding only at a run's end
        seen += real.tolist()
    assert sorted(seen) == list(range(slots))
    hit = ids.unique()
    assert (block_expert[block_expert >= 0].unique() == hit).all()
    assert block_expert[block_expert >= 0].diff().ge(0).all()  # experts in ascending order


def test_cpu_path_never_imports_triton() -> None:
    """A SparseMoE built, moved and run on the CPU leaves moe_triton (and triton) unimported."""
    script = textwrap.dedent(
        """
        import sys, torch
        from omni_server.models.qwen3_omni.config import DecoderShape
        from omni_server.models.qwen3_omni.layers import SparseMoE
        shape = DecoderShape(8, 16, 32, 1, 2, 1, 8, 1e-6, 1e6, None, num_experts=4, top_k=2,
                             moe_intermediate_size=8)
        block = SparseMoE(shape).to("cpu", torch.float64)
        for p in block.parameters():
            torch.nn.init.normal_(p)
        out = block(torch.randn(3, 16, dtype=torch.float64))
        assert block.experts.fused is None and out.isfinite().all()
        loaded = [m for m in sys.modules if m == "triton" or m.endswith("moe_triton")]
        assert not loaded, loaded
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
