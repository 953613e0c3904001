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
from omni_server.engine.batcher import Batcher, StepBatch
from omni_server.engine.config import SMOLLM2_135M
from omni_server.engine.kv_cache import BlockAllocator
from omni_server.engine.sequence import Sequence
from omni_server.engine.step_cost import StepCost, keys_per_token


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


def _recording(engine: Engine) -> list[StepBatch]:
    """Every batch the engine's batcher builds (observed, not changed)."""
    batches: list[StepBatch] = []
    schedule = engine.batcher.next_batch

    def recording_schedule(now: float = 0.0) -> StepBatch | None:
        batch = schedule(now)
        if batch is not None:
            batches.append(batch)
        return batch

    engine.batcher.next_batch = recording_schedule  # type: ignore[method-assign]
    return batches


def _cost(engine: Engine, batch: StepBatch) -> tuple[float, float]:
    """(decode cost, prefill cost) of a batch in the batcher's units."""
    cost = engine.batcher.cost
    decodes = sum(cost.decode(seq.num_computed) for seq in batch.decodes)
    return decodes, sum(cost.chunk(w.start, w.length) for w in batch.prefills)


def test_long_prefill_is_chunked_by_cost_beside_running_decodes(
    make_tiny_engine: Callable[..., Engine],
) -> None:
    # Issue 27.2: a long prompt must not stall a running stream. Its chunks are bounded by their
    # attention's cost (a token at context c weighs 1 + c / 64 here), not their length, and
    # every step that carries one also carries the stream's next token.
    engine = make_tiny_engine(
        max_total_tokens=512, max_step_tokens=48, max_batch_size=4, attention_keys_per_token=64
    )
    assert engine.batcher.prefill_beside_decodes == 32  # the CPU's default
    short = GenerationRequest("short", _prompt(5), _params(60))
    long = GenerationRequest("long", _prompt(300, offset=1), _params(5, seed=1))
    batches = _recording(engine)
    out: dict[str, list[TokenEvent]] = {"short": [], "long": []}
    engine.add(short)
    chunks: list[tuple[int, int]] = []  # the long prompt's (start, length) while short decodes
    while engine.has_work():
        events = engine.step()
        if len(out["short"]) == 1 and not out["long"]:
            engine.add(long)  # joins while short is decoding
        batch = batches[-1]
        work = [w for w in batch.prefills if w.seq.request_id == "long"]
        if work and not out["short"][-1].finished:
            assert "short" in {e.request_id for e in events}  # the stream got its token
            chunks.append((work[0].start, work[0].length))
            decode_cost, prefill_cost = _cost(engine, batch)
            assert prefill_cost <= 32 or work[0].length <= 16  # the bound, or the 1-block floor
            assert decode_cost + prefill_cost <= 48 or work[0].length <= 16
        for e in events:
            out[e.request_id].append(e)
    assert sum(n for _, n in chunks) == 300  # short decoded through the whole prefill
    lengths = [n for _, n in chunks]
    assert lengths == sorted(lengths, reverse=True)  # longer context, shorter chunks
    assert lengths[0] >= 2 * lengths[-1]  # a token-count budget would keep them equal
    assert _ids(out["long"]) == _alone(make_tiny_engine, long)
    assert _ids(out["short"]) == _alone(make_tiny_engine, short)


def test_short_prompt_is_not_held_behind_a_long_prefill(
    make_tiny_engine: Callable[..., Engine],
) -> None:
    # Issue 27.2: a new 4-token chat waited for a 7.8k-token prompt's whole prefill. Now it is
    # admitted and prefilled in the next step while the long prompt keeps advancing.
    engine = make_tiny_engine(
        max_total_tokens=512, max_step_tokens=48, max_batch_size=4, attention_keys_per_token=64
    )
    stream = GenerationRequest("stream", _prompt(5), _params(80))
    long = GenerationRequest("long", _prompt(400, offset=1), _params(3, seed=1))
    chat = GenerationRequest("chat", _prompt(4, offset=2), _params(3, seed=2))
    batches = _recording(engine)
    engine.add(stream)
    engine.add(long)
    out: dict[str, list[TokenEvent]] = {"stream": [], "long": [], "chat": []}
    long_done: list[int] = []  # prompt tokens of long computed after each step
    while engine.has_work():
        events = engine.step()
        long_work = [w for w in batches[-1].prefills if w.seq.request_id == "long"]
        if long_work:
            long_done.append(long_work[0].start + long_work[0].length)
        if len(long_done) == 3:
            engine.add(chat)  # arrives while the long prompt is mid-prefill
        for e in events:
            out[e.request_id].append(e)
        if len(out["chat"]) == 1 and len(out["chat"][0].token_ids) == 1:
            assert not out["long"]  # chat's first token came while long was still prefilling
            assert long_done[-1] < 400
            chat_first_at = len(long_done)
    assert chat_first_at == 4  # the very next step after it arrived
    assert long_done == sorted(set(long_done)) and long_done[-1] == 400  # long always advanced
    assert len(_ids(out["stream"])) == 80
    for request in (stream, long, chat):
        assert _ids(out[request.request_id]) == _alone(make_tiny_engine, request)


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
    with pytest.raises(ValueError, match=r"engine\.attention_keys_per_token must be a positive"):
        EngineConfig.from_table({"attention_keys_per_token": 0})
    with pytest.raises(ValueError, match=r"engine\.max_prefill_beside_decodes must be a positive"):
        EngineConfig.from_table({"max_prefill_beside_decodes": "all"})
    with pytest.raises(ValueError, match=r"engine\.decode_attention must be one of"):
        EngineConfig.from_table({"decode_attention": "flash"})


def test_decode_attention_paged_needs_cuda(make_tiny_engine: Callable[..., Engine]) -> None:
    with pytest.raises(ValueError, match="'paged' needs a CUDA device and Triton"):
        make_tiny_engine(decode_attention="paged")
    assert not make_tiny_engine().runner.paged  # "auto" on the CPU: the gathered SDPA path


def test_step_cost_fits_the_budget_exactly() -> None:
    cost = StepCost(keys=100)
    assert cost.chunk(0, 10) == 10 + 55 / 100
    assert cost.decode(99) == 2.0  # 100 keys: one more unit
    for start, remaining, budget in [(0, 1000, 48), (300, 1000, 48), (5000, 10, 48), (0, 5, 999)]:
        n = cost.fit(start, remaining, budget)
        assert cost.chunk(start, n) <= budget
        assert n == remaining or cost.chunk(start, n + 1) > budget
    assert cost.fit(0, 10, 0) == 0
    # the embedded SmolLM2 on the CPU: attention a fifth as efficient as its matmuls
    assert 700 < keys_per_token(SMOLLM2_135M, "cpu") < 850
    assert keys_per_token(SMOLLM2_135M, "cuda") == pytest.approx(
        keys_per_token(SMOLLM2_135M, "cpu") / 2, rel=0.01
    )


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


def test_a_row_not_ready_sits_the_step_out_and_a_waiting_one_is_not_admitted() -> None:
    """The head's optional `ready` (head.py): a running request whose next input is not in yet
    takes no row this step and keeps its blocks (no preemption); a waiting one is not admitted
    (head of line). Once ready, both run."""
    config = EngineConfig(max_total_tokens=64 * 16, max_batch_size=4, max_step_tokens=64)
    batcher = Batcher(config, BlockAllocator(64, 16), StepCost(10**9), 8)
    seqs = [
        Sequence(GenerationRequest(name, _prompt(4), _params(8)), 8, None, arrival=i)
        for i, name in enumerate(["a", "b"])
    ]
    batcher.add(seqs[0])
    batcher.next_batch()  # "a" admitted and prefilled
    seqs[0].num_computed, seqs[0].token_ids = 4, [*seqs[0].token_ids, 9]  # its first token
    batcher.add(seqs[1])
    held: set[str] = {"a", "b"}
    batcher.ready = lambda seq: seq.request_id not in held
    blocks = list(seqs[0].block_table)
    assert batcher.next_batch() is None  # "a" waits for its input, "b" is not admitted
    assert seqs[0].block_table == blocks and batcher.num_preemptions == 0
    assert [s.request_id for s in batcher.waiting] == ["b"]
    held.clear()
    batch = batcher.next_batch()
    assert batch is not None and batch.decodes == [seqs[0]]
    assert [p.seq for p in batch.prefills] == [seqs[1]]


def test_a_prompt_token_left_alone_is_a_prefill_chunk_never_a_decode() -> None:
    """A prompt whose chunks leave its last token alone prefills it as a chunk of one row: a
    decode row is always an output position (a head builds a decode's input from what the
    request generated: Higgs' frames, the talker's codes). On the H200 a Higgs prompt chunked
    so broke the decode graph's inputs (KeyError in fill_graph_inputs, the replica down)."""
    # a budget of 16 tokens of prefill a step: a 17-token prompt leaves one behind
    config = EngineConfig(max_total_tokens=64 * 16, max_batch_size=4, max_step_tokens=16)
    batcher = Batcher(config, BlockAllocator(64, 16), StepCost(10**9), 8)
    seq = Sequence(GenerationRequest("a", _prompt(17), _params(8)), 8, None, arrival=0)
    batcher.add(seq)
    first = batcher.next_batch()
    assert first is not None and [(p.start, p.length) for p in first.prefills] == [(0, 16)]
    seq.num_computed = 16
    assert not seq.decodes_next and seq.prefills_next
    second = batcher.next_batch()
    assert second is not None and second.decodes == []
    assert [(p.start, p.length) for p in second.prefills] == [(16, 1)]
    seq.num_computed, seq.token_ids = 17, [*seq.token_ids, 9]  # its first output token
    assert seq.decodes_next and not seq.prefills_next
    third = batcher.next_batch()
    assert third is not None and third.decodes == [seq] and third.prefills == []
