"""The CPU decode step's fast paths give the numbers of the general ones: a lone request's
attention over its span of cache slots (read in place) against the gathered, masked path; the
weights packed into one huge-page buffer against the same weights where torch put them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import omni_server.engine.llama as llama_module
from omni_server.engine import Engine, GenerationRequest, SamplingParams
from omni_server.engine.attention import DecodeGroup, ForwardBatch, PrefillChunk, paged_attention
from omni_server.engine.huge_pages import HUGE_PAGE, pack_parameters
from omni_server.engine.llama import Llama
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
        prefills = [PrefillChunk(1, chunk, torch.arange(160, 160 + chunk), None)]
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
    packed = pack_parameters(model, torch.float32)
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
