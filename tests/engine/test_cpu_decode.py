"""The CPU decode step's fast paths give the numbers of the general ones: a lone request's
attention over its span of cache slots (read in place) against the gathered, masked path; the
weights packed into one huge-page buffer against the same weights where torch put them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

import omni_server.engine.families.llama.model as llama_module
from omni_server.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from omni_server.engine.attention import DecodeGroup, ForwardBatch, PrefillChunk, paged_attention
from omni_server.engine.families.llama.model import Llama
from omni_server.engine.huge_pages import HUGE_PAGE, pack_parameters
from tests.engine.conftest import TINY

H, HKV, D = 6, 2, 16


def _batch(decode: DecodeGroup, tokens: int, prefills: list[PrefillChunk]) -> ForwardBatch:
    zeros = torch.zeros(tokens, dtype=torch.int64)
    return ForwardBatch(zeros, zeros, zeros, zeros, decode, prefills)


@pytest.mark.parametrize("chunk", [0, 5], ids=["decode", "decode+prefill"])
def test_span_attention_equals_the_gathered_path(chunk: int) -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(256, HKV, D, generator=gen) for _ in range(2))
    q = torch.randn(1 + chunk, H, D, generator=gen)
    start, length = 48, 37  # the request's context: slots 48..84
    slots = torch.arange(start, start + length)
    prefills = []
    if chunk:  # another request's first chunk, after the decode row
        prefills = [PrefillChunk(1, chunk, torch.arange(160, 160 + chunk))]
    gathered = DecodeGroup(1, slots.unsqueeze(0), torch.ones(1, 1, 1, length, dtype=torch.bool))
    span = DecodeGroup(1, kv_span=(start, length))
    expected = paged_attention(q, k_cache, v_cache, _batch(gathered, 1 + chunk, prefills))
    got = paged_attention(q, k_cache, v_cache, _batch(span, 1 + chunk, prefills))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_lone_request_reads_its_span_and_a_fragmented_one_the_gather(
    make_tiny_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []  # per batch-1 decode step: did attention get the span form?
    attend = llama_module.paged_attention

    def recording(q, k_cache, v_cache, batch):  # type: ignore[no-untyped-def]
        if batch.decode is not None and batch.decode.num_seqs == 1 and not batch.prefills:
            seen.append(batch.decode.kv_span is not None)
        return attend(q, k_cache, v_cache, batch)

    monkeypatch.setattr(llama_module, "paged_attention", recording)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = list(range(1, 17))  # one block
    alone = make_tiny_engine().generate([GenerationRequest("a", prompt, greedy)])
    assert seen and all(seen)  # its blocks 1, 2, 3 are consecutive: every step in place
    seen.clear()
    # Beside a short request the two take blocks in turn (a: 1, 3; b: 2, 4); when b ends, a's
    # next block is b's freed 2: a's table [1, 3, 2] is no run of slots, so it is gathered.
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    shared = make_tiny_engine().generate(
        [GenerationRequest("a", prompt, greedy), GenerationRequest("b", list(range(20, 36)), short)]
    )
    assert seen and not all(seen) and seen[-1] is False
    tokens = [t for e in alone["a"] for t in e.token_ids]
    assert tokens == [t for e in shared["a"] for t in e.token_ids]


def test_packed_weights_sit_in_one_aligned_buffer_with_their_values() -> None:
    model = Llama(TINY, max_positions=64)
    model.init_random(seed=3)
    before = {name: p.clone() for name, p in model.named_parameters()}
    packed = pack_parameters(model, torch.float32, model.matmul_weights())
    params = list(model.parameters())
    assert packed >= sum(p.numel() * 4 for p in params)
    first = params[0].data_ptr()
    assert first % HUGE_PAGE == 0  # huge pages back only 2 MiB-aligned memory
    ends = [p.data_ptr() + p.numel() * 4 for p in params]
    assert all(p.data_ptr() % 64 == 0 for p in params)
    assert all(a.data_ptr() >= b for a, b in zip(params[1:], ends, strict=False))  # in order
    assert max(ends) - first <= packed  # one buffer
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) and not p.requires_grad, name


def test_wide_matmul_weights_are_stored_by_columns_with_the_same_values() -> None:
    model = Llama(TINY, max_positions=64)
    model.init_random(seed=3)
    before = {name: p.clone() for name, p in model.named_parameters()}
    model.place("cpu", torch.float32)  # the engine's default order: every weight by rows
    assert all(p.is_contiguous() for p in model.parameters())
    model.place("cpu", torch.float32, "columns")
    params = dict(model.named_parameters())
    rows_first = {"layers.0.attn.wo.weight", "layers.0.mlp.w_down.weight"}  # out <= in
    columns = {"layers.0.attn.wqkv.weight", "layers.0.mlp.w_gate_up.weight", "lm_head.weight"}
    for name in columns:
        rows, cols = params[name].shape
        assert rows > cols and params[name].stride() == (1, rows), name
    for name in rows_first:
        assert params[name].is_contiguous(), name
    assert params["norm.weight"].is_contiguous()
    assert params["embed.weight"].is_contiguous()  # an untied embedding is only looked up
    for name, p in params.items():
        assert torch.equal(p, before[name]), name
    # a head tied to the embedding is a matmul weight: stored by columns, looked up the same
    tied = Llama(dataclasses.replace(TINY, tie_word_embeddings=True), max_positions=64)
    tied.init_random(seed=3)
    table = tied.embed.weight.clone()
    tied.place("cpu", torch.float32, "columns")
    assert tied.lm_head is None and tied.embed.weight.stride() == (1, TINY.vocab_size)
    ids = torch.tensor([0, 5, 127])
    assert torch.equal(tied.embed(ids), table[ids])
    # bfloat16 keeps rows: the column order is measured for float32 only
    model.place("cpu", torch.bfloat16, "columns")
    assert all(p.is_contiguous() for p in model.parameters())


def test_the_weight_order_is_one_of_two() -> None:
    assert EngineConfig(cpu_weight_order="columns").cpu_weight_order == "columns"
    with pytest.raises(ValueError, match="cpu_weight_order must be one of"):
        EngineConfig(cpu_weight_order="diagonal")


def greedy_tokens(order: str) -> list[int]:
    config = EngineConfig(max_total_tokens=256, max_batch_size=4, cpu_weight_order=order)
    engine = Engine.from_random(TINY, config, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out = engine.generate([GenerationRequest("a", list(range(3, 40)), greedy)])
    return [t for e in out["a"] for t in e.token_ids]


def test_both_weight_orders_decode_the_same_tokens() -> None:
    assert greedy_tokens("columns") == greedy_tokens("rows")


def test_packing_casts_and_keeps_forwards_equal() -> None:
    model = Llama(TINY, max_positions=64)
    model.init_random(seed=3)
    reference = {name: p.clone() for name, p in model.named_parameters()}
    model.place("cpu", torch.bfloat16)  # on the CPU, place() packs
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, reference[name].to(torch.bfloat16)), name
    with torch.device("meta"):
        unloaded = Llama(TINY, max_positions=64)
    unloaded.place("cpu", torch.float32)  # meta weights get their (uninitialized) space
    assert all(p.device.type == "cpu" for p in unloaded.parameters())
    unloaded.load_state_dict(reference)
    for name, p in unloaded.named_parameters():
        assert torch.equal(p, reference[name]), name
