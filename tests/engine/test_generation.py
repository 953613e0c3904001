"""Generation through the engine: equal to transformers' greedy generate, batch-independent,
seeded sampling reproducible, stop rules."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from omni_server.engine import Engine, FinishReason, GenerationRequest, SamplingParams, TokenEvent
from omni_server.engine.tokenizer import GGUFTokenizer
from tests.engine.conftest import CHAT_PROMPTS

NEW_TOKENS = 20


def _ids(events: list[TokenEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def _text(events: list[TokenEvent]) -> str:
    return "".join(e.text for e in events)


def test_greedy_equals_transformers_generate(
    make_engine: Callable[..., Engine], tokenizer: GGUFTokenizer, hf_model
) -> None:
    engine = make_engine()
    prompts = [tokenizer.encode_chat(m) for m in CHAT_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
    out = engine.generate(GenerationRequest(f"p{i}", p, params) for i, p in enumerate(prompts))
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            generated = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False
            )[0, len(prompt) :].tolist()
        expected = generated[: generated.index(2)] if 2 in generated else generated
        events = out[f"p{i}"]
        assert _ids(events) == expected, f"prompt {i}"
        assert _text(events) == tokenizer.decode(expected)
        assert events[-1].finished and all(not e.finished for e in events[:-1])
        reason = FinishReason.STOP if 2 in generated else FinishReason.LENGTH
        assert events[-1].finish_reason is reason


def _batch_prompts(tokenizer: GGUFTokenizer) -> list[list[int]]:
    questions = [
        "Hi",
        "What is 2 plus 2?",
        "Tell me a long story about a dragon who lived in a cave by the sea and loved books.",
        "Why is the sky blue?",
        "List three fruits.",
        "Translate 'good morning' to French.",
        "What is the boiling point of water in Celsius, and does it change with altitude?",
        "Say something nice.",
    ]
    return [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]


def _run_staggered(
    engine: Engine, requests: list[GenerationRequest], join_after: int
) -> dict[str, list[TokenEvent]]:
    """The first half join at once, the rest one per step after `join_after` steps."""
    out: dict[str, list[TokenEvent]] = {r.request_id: [] for r in requests}
    half = len(requests) // 2
    for r in requests[:half]:
        engine.add(r)
    late = list(requests[half:])
    steps = 0
    while engine.has_work() or late:
        if late and steps >= join_after:
            engine.add(late.pop(0))
        for event in engine.step():
            out[event.request_id].append(event)
        steps += 1
    return out


@pytest.mark.slow
def test_greedy_same_alone_and_in_batch_of_8(
    make_engine: Callable[..., Engine], tokenizer: GGUFTokenizer
) -> None:
    prompts = _batch_prompts(tokenizer)
    params = SamplingParams(temperature=0, max_tokens=12)
    requests = [GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
    alone = {r.request_id: _ids(make_engine().generate([r])[r.request_id]) for r in requests}
    # A small step budget forces chunked prefills beside running decodes.
    engine = make_engine(max_step_tokens=40, max_batch_size=8)
    batched = _run_staggered(engine, requests, join_after=3)
    for r in requests:
        assert _ids(batched[r.request_id]) == alone[r.request_id], r.request_id
    assert engine.cache.allocator.num_free == engine.cache.allocator.num_blocks


def test_seeded_sampling_reproducible_and_batch_independent(
    make_engine: Callable[..., Engine], tokenizer: GGUFTokenizer
) -> None:
    prompt = tokenizer.encode_chat(CHAT_PROMPTS[2])
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_tokens=10)
    target = GenerationRequest("seeded", prompt, params)
    first = _ids(make_engine().generate([target])["seeded"])
    second = _ids(make_engine().generate([target])["seeded"])
    assert first == second and len(first) > 0
    # The same request as the 4th of a batch of 5, among other sampled requests.
    others = [
        GenerationRequest(f"o{i}", tokenizer.encode_chat(m), SamplingParams(seed=i, max_tokens=10))
        for i, m in enumerate(CHAT_PROMPTS + CHAT_PROMPTS[:1])
    ]
    batch = [*others[:3], target, others[3]]
    assert _ids(make_engine().generate(batch)["seeded"]) == first
    other_seed = GenerationRequest(
        "s2", prompt, SamplingParams(temperature=1.0, seed=99, max_tokens=10)
    )
    other_seed_b = GenerationRequest(
        "s3", prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=10)
    )
    outs = make_engine().generate([other_seed, other_seed_b])
    # other seeds draw other tokens (three equal 10-token samples would be a broken generator)
    assert {tuple(_ids(outs["s2"])), tuple(_ids(outs["s3"])), tuple(first)} != {tuple(first)}


def test_eos_stops_and_is_not_in_output(
    make_engine: Callable[..., Engine], tokenizer: GGUFTokenizer
) -> None:
    prompt = tokenizer.encode_chat(CHAT_PROMPTS[0])  # answers in one short sentence
    events = make_engine().generate(
        [GenerationRequest("a", prompt, SamplingParams(temperature=0, max_tokens=60))]
    )["a"]
    assert events[-1].finish_reason is FinishReason.STOP
    assert tokenizer.eos_token_id not in _ids(events)
    assert "Paris" in _text(events)
    assert events[-1].completion_tokens == len(_ids(events)) + 1  # + the EOS token


def test_max_tokens_finishes_with_length(
    make_engine: Callable[..., Engine], tokenizer: GGUFTokenizer
) -> None:
    prompt = tokenizer.encode_chat(CHAT_PROMPTS[2])
    events = make_engine().generate(
        [GenerationRequest("a", prompt, SamplingParams(temperature=0, max_tokens=3))]
    )["a"]
    assert len(_ids(events)) == 3 and events[-1].finish_reason is FinishReason.LENGTH
    assert events[-1].completion_tokens == 3 and events[-1].prompt_tokens == len(prompt)


@pytest.mark.parametrize("stop", ["Paris", "capital of", "s P"])  # the last straddles tokens
def test_stop_string_truncates_and_holds_back(
    make_engine: Callable[..., Engine], tokenizer: GGUFTokenizer, stop: str
) -> None:
    prompt = tokenizer.encode_chat(CHAT_PROMPTS[0])
    greedy = SamplingParams(temperature=0, max_tokens=30)
    full = _text(make_engine().generate([GenerationRequest("f", prompt, greedy)])["f"])
    assert stop in full  # the test's premise: the greedy answer contains the stop string
    params = SamplingParams(temperature=0, max_tokens=30, stop=("never-seen", stop))
    events = make_engine().generate([GenerationRequest("s", prompt, params)])["s"]
    assert events[-1].finish_reason is FinishReason.STOP
    assert _text(events) == full[: full.index(stop)]
    # No delta ever carried text past the stop string (held back until ruled out).
    assert all(stop not in e.text for e in events)


def test_bfloat16_on_cpu_answers_like_float32(gguf, tokenizer: GGUFTokenizer) -> None:
    from omni_server.engine import EngineConfig
    from omni_server.engine.families.llama.model import Llama

    model = Llama(gguf.shape, max_positions=1024)
    model.load_weights(gguf.weights)
    model.place("cpu", torch.bfloat16)
    assert model.embed.weight.dtype == torch.bfloat16 and model.rope.dtype == torch.complex64
    engine = Engine(model, EngineConfig(max_total_tokens=1024, dtype="bfloat16"), tokenizer)
    assert engine.cache.k[0].dtype == torch.bfloat16
    prompt = tokenizer.encode_chat(CHAT_PROMPTS[0])
    events = engine.generate(
        [GenerationRequest("a", prompt, SamplingParams(temperature=0, max_tokens=12))]
    )["a"]
    assert "Paris" in _text(events) and events[-1].finish_reason is FinishReason.STOP
