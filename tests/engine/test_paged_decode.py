"""The paged decode kernel (paged_decode.py) on a GPU: equal to a float64 reference over random
block tables, and the engine through it equal to the gathered path and to transformers.

Marked gpu: skipped without CUDA (the CPU runs the gathered path, tested everywhere else).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_server.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from tests.engine.conftest import TINY

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _reference(q, k_cache, v_cache, tables, lens, block_size):  # type: ignore[no-untyped-def]
    """float64 attention of each row over its context's slots (read through its table)."""
    b, heads, dim = q.shape
    group = heads // k_cache.shape[1]
    out = torch.zeros(b, heads, dim, dtype=torch.float64)
    for row in range(b):
        c = int(lens[row])
        if c == 0:
            continue
        pos = torch.arange(c)
        slots = tables[row, pos // block_size].long() * block_size + pos % block_size
        k, v = k_cache.cpu()[slots].double(), v_cache.cpu()[slots].double()  # [c, Hkv, D]
        for h in range(heads):
            scores = (k[:, h // group] @ q[row, h].cpu().double()) * dim**-0.5
            out[row, h] = scores.softmax(0) @ v[:, h // group]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "lens"),
    [
        (9, 3, 64, [5, 300, 0, 1]),  # SmolLM2's grouping; a padded row (0); one key
        (32, 8, 64, [1100, 17]),  # 1.2B's; 1100 keys split over 3 partitions
        (24, 8, 128, [2900]),  # the 3B's head_dim; 6 partitions
    ],
)
def test_kernel_equals_reference(
    dtype: torch.dtype, heads: int, kv_heads: int, dim: int, lens: list[int]
) -> None:
    from omni_server.engine.paged_decode import paged_decode_attention

    gen = torch.Generator().manual_seed(len(lens) * heads)
    bs = 16
    needed = [-(-c // bs) for c in lens]
    num_blocks = sum(needed) + 3
    slots = (num_blocks + 1) * bs
    k_cache = torch.randn(slots, kv_heads, dim, generator=gen).to("cuda", dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=gen).to("cuda", dtype)
    order = (torch.randperm(num_blocks, generator=gen) + 1).int()  # scattered blocks
    tables = torch.zeros(len(lens), max(needed) + 2, dtype=torch.int32)
    used = 0
    for row, n in enumerate(needed):
        tables[row, :n] = order[used : used + n]
        used += n
    q = torch.randn(len(lens), heads, dim, generator=gen).to("cuda", dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_attention(q, k_cache, v_cache, tables.cuda(), lens_t.cuda(), bs)
    # again: the split kernel's last program of each (request, KV head) merges and puts its
    # ticket counter back to 0; a counter left over would leave this output unmerged
    again = paged_decode_attention(q, k_cache, v_cache, tables.cuda(), lens_t.cuda(), bs)
    torch.cuda.synchronize()
    assert torch.equal(out, again)
    ref = _reference(q, k_cache, v_cache, tables, lens_t, bs)
    assert torch.isfinite(out).all()
    err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err
    assert (out[torch.tensor(lens) == 0] == 0).all()  # a padded row writes zeros


def _tokens(engine: Engine, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    out = engine.generate(requests)
    return {rid: [t for e in events for t in e.token_ids] for rid, events in out.items()}


def _requests(n: int, greedy: bool) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"r{i}",
            [(5 * j + i) % 100 + 1 for j in range(7 + 61 * i)],
            SamplingParams(
                temperature=0.0 if greedy else 1.0, seed=i, max_tokens=40, ignore_eos=True
            ),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_engine_paged_equals_gathered(cuda_graphs: bool) -> None:
    """float32: the paged kernel samples exactly the gathered path's tokens (seeded, a batch
    of 5 requests of 7..251 prompt tokens), eager and through the decode graphs."""

    def run(attention: str) -> dict[str, list[int]]:
        config = EngineConfig(
            max_total_tokens=4096,
            max_batch_size=8,
            device="cuda",
            dtype="float32",
            cuda_graphs=cuda_graphs,
            decode_attention=attention,
        )
        engine = Engine.from_random(TINY, config, seed=3)
        assert engine.runner.paged is (attention == "paged")
        return _tokens(engine, _requests(5, greedy=False))

    assert run("paged") == run("gather")


def test_engine_paged_greedy_equals_transformers(tmp_path: Path) -> None:
    """A tiny Llama checkpoint folder: greedy tokens of the engine (paged kernel, CUDA graphs,
    float32) equal transformers' greedy `generate` on the same folder."""
    transformers = pytest.importorskip("transformers")
    from omni_bench.random_checkpoint import write_llama

    folder = write_llama(tmp_path / "llama", "tiny")
    config = EngineConfig(max_total_tokens=4096, max_batch_size=4, device="cuda")
    engine = Engine.from_checkpoint(folder, config)
    assert engine.runner.paged and engine.runner.graphs is not None
    requests = _requests(3, greedy=True)
    ours = _tokens(engine, requests)
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    for request in requests:
        ids = torch.tensor([request.prompt_token_ids], device="cuda")
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False)
        assert ours[request.request_id] == out[0, ids.shape[1] :].tolist(), request.request_id


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_kernels_equal_torch(dtype: torch.dtype) -> None:
    """fused.py against the torch ops it replaces (llama.py's CPU path), same inputs."""
    from omni_server.engine import fused
    from omni_server.engine.families.llama.model import RMSNorm, rope_table
    from omni_server.engine.kernels import apply_rope

    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(576, 1e-5).to("cuda", dtype)
    norm.weight.copy_(torch.rand(576, generator=gen) + 0.5)
    x = (torch.randn(37, 576, generator=gen) * 3).to("cuda", dtype)
    torch_norm = norm.weight * torch.nn.functional.rms_norm(x.float(), (576,), None, 1e-5).to(dtype)
    diff = (fused.rms_norm(x, norm.weight, 1e-5).float() - torch_norm.float()).abs()
    assert diff.max().item() <= 2 * torch.finfo(dtype).eps * torch_norm.float().abs().max().item()

    heads, kv_heads, dim, tokens = 9, 3, 64, 21
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to("cuda", dtype)
    positions = torch.randint(0, 4000, (tokens,), generator=gen).cuda()
    rope = rope_table(TINY.__class__(**{**TINY.__dict__, "head_dim": dim}), 4096).cuda()
    rope = rope[positions].unsqueeze(1)
    slots = torch.randperm(200, generator=gen)[:tokens].cuda()
    k_cache = torch.zeros(200, kv_heads, dim, dtype=dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    q = fused.rope_kv(qkv, rope, slots, k_cache, v_cache, heads)
    qk = apply_rope(qkv[:, : (heads + kv_heads) * dim].view(tokens, -1, dim), rope)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(q.float(), qk[:, :heads].float(), atol=tol, rtol=tol)
    assert torch.allclose(k_cache[slots].float(), qk[:, heads:].float(), atol=tol, rtol=tol)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    assert torch.equal(v_cache[slots], v)
    gate_up = torch.randn(tokens, 2 * 1536, generator=gen).to("cuda", dtype)
    gate, up = gate_up.split(1536, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    assert torch.allclose(fused.silu_mul(gate_up).float(), expected.float(), atol=tol, rtol=tol)
    # add + norm in one kernel: the sum rounded as torch's add, the norm as fused.rms_norm
    delta = (torch.randn(37, 576, generator=gen) * 3).to("cuda", dtype)
    total, normed = fused.add_rms_norm(delta, x, norm.weight, 1e-5)
    assert torch.equal(total, x + delta)
    assert torch.equal(normed, fused.rms_norm(x + delta, norm.weight, 1e-5))
    untouched = torch.ones(200, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert (k_cache[untouched] == 0).all() and (v_cache[untouched] == 0).all()
    # rows of a view (a one-KV-head model's k_norm reads K's 64 columns of a fused [T, H*D]
    # projection): the output is contiguous and the norm of each row; writing it at the view's
    # row stride overran it (the Qwen3-Omni talker's bf16 fault, docs/gpu.md)
    fused_qkv = (torch.randn(tokens, 4 * dim, generator=gen) * 3).to("cuda", dtype)
    k_rows = fused_qkv[:, 2 * dim : 3 * dim]  # stride (4 * dim, 1)
    head_norm = RMSNorm(dim, 1e-6).to("cuda", dtype)
    expected = head_norm.weight * torch.nn.functional.rms_norm(
        k_rows.float(), (dim,), None, 1e-6
    ).to(dtype)
    strided = fused.rms_norm(k_rows, head_norm.weight, 1e-6)
    assert strided.is_contiguous() and strided.shape == (tokens, dim)
    bound = 2 * torch.finfo(dtype).eps * expected.float().abs().max().item()
    assert (strided.float() - expected.float()).abs().max().item() <= bound


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_deferred_adds_equal_the_plain_layers(dtype: torch.dtype) -> None:
    """Two decoder layers with each residual add done by the next norm (forward_deferred, the
    CUDA path in bf16/fp16) give the plain layers' residual stream to the last bit."""
    from omni_server.engine.attention import DecodeGroup, ForwardBatch
    from omni_server.engine.families.llama.model import DecoderLayer, Llama

    model = Llama(TINY, max_positions=256).place("cuda", dtype)
    model.init_random(5)
    layers = [layer for layer in model.layers if isinstance(layer, DecoderLayer)][:2]
    assert len(layers) == 2
    gen = torch.Generator().manual_seed(2)
    b, bs = 3, 16
    h0 = torch.randn(b, TINY.hidden_size, generator=gen).to("cuda", dtype)
    shape = model.local_shape
    caches = [
        torch.randn(64, shape.num_kv_heads, shape.head_dim, generator=gen).to("cuda", dtype)
        for _ in range(4)
    ]
    batch = ForwardBatch(
        input_ids=torch.zeros(b, dtype=torch.int64, device="cuda"),
        positions=torch.tensor([4, 20, 33], device="cuda"),
        slot_mapping=torch.tensor([20, 52, 49], device="cuda"),  # distinct: no write race
        logits_indices=torch.arange(b, device="cuda"),
        decode=DecodeGroup(
            b,
            block_tables=torch.tensor(
                [[1, 0, 0], [2, 3, 0], [2, 1, 3]], dtype=torch.int32, device="cuda"
            ),
            context_lens=torch.tensor([5, 21, 34], dtype=torch.int32, device="cuda"),
            block_size=bs,
        ),
        prefills=[],
    )
    rope = model.rope_rows(batch.positions)
    plain, deferred = h0, h0
    delta = None
    with torch.inference_mode():
        for i, layer in enumerate(layers):
            plain = layer(plain, rope, caches[2 * i], caches[2 * i + 1], batch)
            deferred, delta = layer.forward_deferred(
                deferred, delta, rope, caches[2 * i], caches[2 * i + 1], batch
            )
    assert delta is not None
    assert torch.equal(deferred + delta, plain)
