"""Continuous batching on a tiny random Llama (weights do not matter here, speed does):
admission by KV capacity, preemption, abort, chunked prefill beside decodes, clear errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from omni_server.engine import (
    ContextLengthExceeded,
    Engine,
    EngineConfig,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from omni_server.engine.batcher import StepBatch


def _prompt(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 120 + 1 for i in range(n)]


def _params(max_tokens: int, seed: int = 0) -> SamplingParams:
    # Seeded sampling, not greedy: a random tiny model's greedy output soon repeats one token,
    # which would make "same tokens" comparisons weak. Seeded draws are just as deterministic.
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def _ids(events: list[TokenEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def _alone(make: Callable[..., Engine], request: GenerationRequest) -> list[int]:
    return _ids(make(max_total_tokens=512).generate([request])[request.request_id])


def test_prompt_that_can_never_fit_is_a_clear_error(
    make_tiny_engine: Callable[..., Engine],
) -> None:
    engine = make_tiny_engine(max_total_tokens=64)
    assert engine.max_seq_len == 64  # clamped to the cache: one request alone always fits
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 64") as info:
        engine.add(GenerationRequest("big", _prompt(64), _params(1)))
    assert info.value.code == "context_length_exceeded" and info.value.prompt_tokens == 64
    with pytest.raises(ContextLengthExceeded, match=r"60 in the messages, 10 in the completion"):
        engine.add(GenerationRequest("big2", _prompt(60), _params(10)))
    assert not engine.has_work()  # nothing was queued
    engine.add(GenerationRequest("fits", _prompt(60), _params(4)))  # exactly 64: fine
    assert len(_ids(engine.generate([])["fits"])) == 4


def test_bad_requests_rejected(make_tiny_engine: Callable[..., Engine]) -> None:
    engine = make_tiny_engine()
    with pytest.raises(ValueError, match="no tokens"):
        engine.add(GenerationRequest("e", [], _params(1)))
    with pytest.raises(ValueError, match=r"\[0, 128\)"):
        engine.add(GenerationRequest("v", [5, 128], _params(1)))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add(GenerationRequest("s", [5], SamplingParams(stop=("x",))))
    engine.add(GenerationRequest("d", [5], _params(1)))
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add(GenerationRequest("d", [6], _params(1)))


def test_admission_waits_while_kv_is_full(make_tiny_engine: Callable[..., Engine]) -> None:
    # 6 blocks of 16: A's 60-token prompt takes 4, B's 40 tokens need 3 -> B must wait for A.
    engine = make_tiny_engine(max_total_tokens=96, block_size=16)
    a = GenerationRequest("a", _prompt(60), _params(4))
    b = GenerationRequest("b", _prompt(40, offset=3), _params(4, seed=1))
    engine.add(a)
    engine.add(b)
    events = engine.step()
    assert [e.request_id for e in events] == ["a"]
    assert engine.num_running == 1 and engine.num_waiting == 1  # waiting, not failed
    out: dict[str, list[TokenEvent]] = {"a": events, "b": []}
    while engine.has_work():
        for e in engine.step():
            out[e.request_id].append(e)
            if e.request_id == "b" and len(out["b"]) == 1:
                assert out["a"][-1].finished  # b was admitted only after a freed its blocks
    assert out["b"][-1].finish_reason is FinishReason.LENGTH
    assert _ids(out["a"]) == _alone(make_tiny_engine, a)
    assert _ids(out["b"]) == _alone(make_tiny_engine, b)
    assert engine.cache.allocator.num_free == engine.cache.allocator.num_blocks


def test_preemption_recomputes_and_keeps_outputs(make_tiny_engine: Callable[..., Engine]) -> None:
    # 8 blocks of 16 = 128 tokens; three requests growing to 20 + 40 tokens each cannot all fit.
    engine = make_tiny_engine(max_total_tokens=128, block_size=16)
    requests = [GenerationRequest(f"r{i}", _prompt(20, offset=i), _params(40, i)) for i in range(3)]
    out = engine.generate(requests)
    assert engine.batcher.num_preemptions > 0
    for r in requests:
        assert len(_ids(out[r.request_id])) == 40
        assert _ids(out[r.request_id]) == _alone(make_tiny_engine, r), r.request_id
    assert engine.cache.allocator.num_free == engine.cache.allocator.num_blocks


def test_abort_frees_kv_at_once(make_tiny_engine: Callable[..., Engine]) -> None:
    engine = make_tiny_engine(max_total_tokens=256)
    allocator = engine.cache.allocator
    engine.add(GenerationRequest("run", _prompt(50), _params(100)))
    engine.add(GenerationRequest("other", _prompt(30), _params(100)))
    for _ in range(3):
        engine.step()
    assert allocator.num_free < allocator.num_blocks
    assert engine.abort("run") and engine.abort("other")
    assert allocator.num_free == allocator.num_blocks  # before any further step
    events = engine.step()
    assert {(e.request_id, e.finish_reason) for e in events} == {
        ("run", FinishReason.ABORT),
        ("other", FinishReason.ABORT),
    }
    assert all(e.finished and e.token_ids == [] for e in events)
    assert not engine.has_work()
    assert not engine.abort("run")  # already gone
    assert not engine.abort("never-added")


def test_abort_of_a_waiting_request(make_tiny_engine: Callable[..., Engine]) -> None:
    engine = make_tiny_engine(max_total_tokens=64, block_size=16)
    engine.add(GenerationRequest("a", _prompt(50), _params(8)))
    engine.add(GenerationRequest("b", _prompt(50), _params(8)))
    engine.step()
    assert engine.num_waiting == 1
    assert engine.abort("b")
    assert engine.num_waiting == 0
    out = engine.generate([])
    assert out["b"][-1].finish_reason is FinishReason.ABORT
    assert out["a"][-1].finish_reason is FinishReason.LENGTH


def test_long_prefill_is_chunked_beside_running_decodes(
    make_tiny_engine: Callable[..., Engine],
) -> None:
    engine = make_tiny_engine(max_total_tokens=512, max_step_tokens=48, max_batch_size=4)
    short = GenerationRequest("short", _prompt(5), _params(30))
    long = GenerationRequest("long", _prompt(300, offset=1), _params(5, seed=1))
    batches: list[StepBatch] = []
    schedule = engine.batcher.next_batch

    def recording_schedule() -> StepBatch | None:  # observe, do not change
        batch = schedule()
        if batch is not None:
            batches.append(batch)
        return batch

    engine.batcher.next_batch = recording_schedule  # type: ignore[method-assign]
    out: dict[str, list[TokenEvent]] = {"short": [], "long": []}
    engine.add(short)
    steps_with_long_prefill = 0
    while engine.has_work():
        events = engine.step()
        if len(out["short"]) == 1 and not out["long"]:
            engine.add(long)  # joins while short is decoding
        prefilling_long = any(w.seq.request_id == "long" for w in batches[-1].prefills)
        if prefilling_long:
            steps_with_long_prefill += 1
            assert "short" in {e.request_id for e in events} or out["short"][-1].finished
        for e in events:
            out[e.request_id].append(e)
    assert all(b.num_tokens <= 48 for b in batches)
    assert steps_with_long_prefill == -(-300 // 47)  # 47 prompt tokens a step beside 1 decode
    assert _ids(out["long"]) == _alone(make_tiny_engine, long)
    assert _ids(out["short"]) == _alone(make_tiny_engine, short)


def test_engine_config_from_table_errors() -> None:
    assert EngineConfig.from_table({"max_total_tokens": 1024, "dtype": "bfloat16"}).dtype == (
        "bfloat16"
    )
    with pytest.raises(ValueError, match="unknown engine field"):
        EngineConfig.from_table({"max_tokens_total": 1})
    with pytest.raises(ValueError, match=r"engine\.max_total_tokens must be a positive integer"):
        EngineConfig.from_table({"max_total_tokens": "lots"})
    with pytest.raises(ValueError, match=r"engine\.dtype"):
        EngineConfig.from_table({"dtype": "int8"})
    with pytest.raises(ValueError, match="max_step_tokens"):
        EngineConfig.from_table({"max_step_tokens": 8, "max_batch_size": 8})
    with pytest.raises(ValueError, match="cuda_graphs must be true or false"):
        EngineConfig.from_table({"cuda_graphs": "yes"})


def test_finish_ends_a_request_as_its_length_limit_would(
    make_tiny_engine: Callable[..., Engine],
) -> None:
    """What a stage's timeout_s asks for: the answer so far, finish_reason "length", the KV
    freed at once; the other request runs on."""
    engine = make_tiny_engine(max_total_tokens=256)
    allocator = engine.cache.allocator
    engine.add(GenerationRequest("cut", _prompt(20), _params(100)))
    engine.add(GenerationRequest("runs", _prompt(20), _params(100)))
    made = sum(len(e.token_ids) for _ in range(4) for e in engine.step() if e.request_id == "cut")
    free_before = allocator.num_free
    assert engine.finish("cut")
    assert allocator.num_free > free_before  # its blocks, before any further step
    events = {e.request_id: e for e in engine.step()}
    assert events["cut"].finished and events["cut"].finish_reason is FinishReason.LENGTH
    assert events["cut"].completion_tokens == made and events["cut"].token_ids == []
    assert not events["runs"].finished
    assert not engine.finish("cut") and not engine.finish("never-added")
