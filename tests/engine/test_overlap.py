"""Decode steps launched ahead of their tokens (overlap.py) give exactly the synchronous steps'
events: greedy and seeded rows, requests joining and stopping mid-run, preemption, abort, KV
freed. On the CPU through `overlap_decode = "on"` (eager steps: the runner's own feed); the
CUDA-graph feed is checked on a GPU (marked gpu)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from omni_server.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, TokenEvent
from omni_server.engine.overlap import PENDING
from tests.engine.conftest import TINY


def _prompt(n: int, offset: int = 0) -> list[int]:
    return [(7 * j + 3 * offset) % 120 + 1 for j in range(n)]


def _run(engine: Engine, requests: list[GenerationRequest], late: int = 0) -> tuple:
    """Events per request, the first `late` requests' arrival delayed by 5 steps; and how many
    steps returned with a step in flight."""
    out: dict[str, list[TokenEvent]] = {r.request_id: [] for r in requests}
    early, delayed = requests[late:], requests[:late]
    for r in early:
        engine.add(r)
    steps = in_flight = 0
    while engine.has_work() or delayed:
        if steps == 5:
            for r in delayed:
                engine.add(r)
            delayed = []
        for event in engine.step():
            out[event.request_id].append(event)
        steps += 1
        in_flight += engine.step_in_flight
    return out, in_flight


def _summary(out: dict[str, list[TokenEvent]]) -> dict[str, tuple]:
    return {
        rid: (
            [t for e in events for t in e.token_ids],
            events[-1].finish_reason,
            events[-1].completion_tokens,
            sum(e.finished for e in events),
        )
        for rid, events in out.items()
    }


def _greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("late", [0, 2])
def test_overlapped_steps_equal_synchronous_steps(
    make_tiny_engine: Callable[..., Engine], late: int
) -> None:
    # a token request "c" produces at its 6th step when run alone: its stop id below
    alone = make_tiny_engine().generate([GenerationRequest("c", _prompt(5, 2), _greedy(40))])
    stop = [t for e in alone["c"] for t in e.token_ids][5]

    def requests() -> list[GenerationRequest]:
        return [
            GenerationRequest("a", _prompt(9), _greedy(30)),
            GenerationRequest("b", _prompt(21, 1), _greedy(12)),
            GenerationRequest("c", _prompt(5, 2), _greedy(40, stop_token_ids=(stop,))),
            GenerationRequest("d", _prompt(14, 3), SamplingParams(seed=4, max_tokens=18)),
            GenerationRequest("e", _prompt(3, 4), _greedy(25)),
        ]

    sync, _ = _run(make_tiny_engine(overlap_decode="off"), requests(), late)
    engine = make_tiny_engine(overlap_decode="on")
    ahead, in_flight = _run(engine, requests(), late)
    assert _summary(ahead) == _summary(sync)
    assert in_flight > 10  # steps really went in flight
    assert sync["c"][-1].finish_reason.value == "stop"  # it stopped mid-run
    allocator = engine.cache.allocator
    assert allocator.num_free == allocator.num_blocks
    assert not engine.has_work()


def test_seeded_rows_go_in_flight_and_draw_as_synchronous_steps(
    make_tiny_engine: Callable[..., Engine],
) -> None:
    """Only sampled rows (top-k / top-p / min-p, seeded and not): every decode step goes in
    flight, its draws fed on the device; seeded tokens equal the synchronous steps'."""

    def requests() -> list[GenerationRequest]:
        sampled = [
            SamplingParams(seed=11, max_tokens=30),
            SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=12, max_tokens=24),
            SamplingParams(temperature=1.3, min_p=0.05, seed=13, max_tokens=27),
        ]
        return [GenerationRequest(f"s{i}", _prompt(6 + 5 * i, i), p) for i, p in enumerate(sampled)]

    sync, _ = _run(make_tiny_engine(overlap_decode="off"), requests(), late=1)
    engine = make_tiny_engine(overlap_decode="on")
    ahead, in_flight = _run(engine, requests(), late=1)
    assert _summary(ahead) == _summary(sync)
    assert in_flight > 20
    assert engine.cache.allocator.num_free == engine.cache.allocator.num_blocks


def test_overlap_with_preemption(make_tiny_engine: Callable[..., Engine]) -> None:
    # 8 blocks of 16 tokens: three requests growing to 20 + 40 tokens cannot all fit
    def requests() -> list[GenerationRequest]:
        return [GenerationRequest(f"r{i}", _prompt(20, i), _greedy(40)) for i in range(3)]

    sync, _ = _run(make_tiny_engine(overlap_decode="off", max_total_tokens=128), requests())
    engine = make_tiny_engine(overlap_decode="on", max_total_tokens=128)
    ahead, in_flight = _run(engine, requests())
    assert engine.batcher.num_preemptions > 0 and in_flight > 0
    assert _summary(ahead) == _summary(sync)
    assert engine.cache.allocator.num_free == engine.cache.allocator.num_blocks


def test_abort_and_finish_while_in_flight(make_tiny_engine: Callable[..., Engine]) -> None:
    engine = make_tiny_engine(overlap_decode="on")
    engine.add(GenerationRequest("x", _prompt(10), _greedy(50)))
    engine.add(GenerationRequest("y", _prompt(12, 1), _greedy(50)))
    engine.add(GenerationRequest("z", _prompt(8, 2), _greedy(50)))
    got: dict[str, list[TokenEvent]] = {"x": [], "y": [], "z": []}
    for _ in range(6):
        for e in engine.step():
            got[e.request_id].append(e)
    assert engine.step_in_flight
    assert engine.abort("x")  # settles the step in flight first: its tokens come out too
    assert engine.finish("y")
    assert not engine.step_in_flight
    assert PENDING not in engine.batcher.running[0].token_ids
    while engine.has_work():
        for e in engine.step():
            got[e.request_id].append(e)
    sync = make_tiny_engine(overlap_decode="off").generate(
        [GenerationRequest("z", _prompt(8, 2), _greedy(50))]
    )
    for rid, reason in (("x", "abort"), ("y", "length")):
        events = got[rid]
        assert events[-1].finished and events[-1].finish_reason.value == reason
        emitted = sum(len(e.token_ids) for e in events)
        assert events[-1].completion_tokens == emitted  # no PENDING counted
    assert [t for e in got["z"] for t in e.token_ids] == [t for e in sync["z"] for t in e.token_ids]
    assert engine.cache.allocator.num_free == engine.cache.allocator.num_blocks


def test_overlap_is_off_by_default_on_the_cpu(make_tiny_engine: Callable[..., Engine]) -> None:
    assert not make_tiny_engine().overlaps_decode
    with pytest.raises(ValueError, match="overlap_decode"):
        EngineConfig(overlap_decode="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_overlap_equals_synchronous_on_gpu(dtype: str) -> None:
    """The decode graphs' feed: in flight (auto on CUDA) == overlap off, token for token."""

    def run(mode: str) -> tuple:
        config = EngineConfig(
            max_total_tokens=2048, max_batch_size=8, device="cuda", dtype=dtype,
            overlap_decode=mode,
        )  # fmt: skip
        engine = Engine.from_random(TINY, config, seed=3)
        requests = [
            GenerationRequest(f"r{i}", _prompt(7 + 11 * i, i), _greedy(24 + 9 * i))
            for i in range(5)
        ]
        requests.append(GenerationRequest("s", _prompt(6), SamplingParams(seed=1, max_tokens=20)))
        out, in_flight = _run(engine, requests, late=2)
        assert engine.overlaps_decode == (mode == "auto")
        assert engine.cache.allocator.num_free == engine.cache.allocator.num_blocks
        return _summary(out), in_flight

    ahead, in_flight = run("auto")
    sync, _ = run("off")
    assert ahead == sync and in_flight > 10
