"""Seeded draws replayed from CUDA graphs (draw_graphs.py) equal the eager draws, and stay
independent of the batch a request ran in (text tokens here; Higgs frames in
test_higgs_audio.py). On a GPU (marked gpu); on the CPU only the replay's plumbing, with a
stand-in for the CUDA graph (the CPU side of the draw itself is test_sampling.py's)."""

from __future__ import annotations

import pytest
import torch

from omni_server.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, draw_graphs
from omni_server.engine.cuda_graphs import bucket_for
from omni_server.engine.draw_graphs import DrawGraphs
from omni_server.engine.sampling import graph_draw, greedy_tokens, sample_on_device, sampling_row
from omni_server.models.draws import request_seed, step_table, uniforms
from tests.engine.conftest import TINY

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SETTINGS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=2),
    SamplingParams(temperature=1.2, min_p=0.05, seed=3),
    SamplingParams(temperature=1.0, top_p=0.5),  # unseeded
]


@pytest.mark.gpu
@needs_gpu
def test_graph_replays_equal_the_eager_draw_and_the_cpu_uniforms() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=gen)
    table = step_table(
        [(*sampling_row(p, request_seed(p.seed)), 40 + i) for i, p in enumerate(SETTINGS)]
    )
    dev = torch.device("cuda")
    assert torch.equal(uniforms(table.to(dev)).cpu(), uniforms(table))  # the same bits
    greedy = greedy_tokens(logits.to(dev))
    eager = sample_on_device(logits.to(dev), table.to(dev), greedy)
    graphs = DrawGraphs(graph_draw, 8, dev)
    replayed = graphs(None, logits.to(dev), [table, greedy]).clone()
    assert torch.equal(replayed, eager)
    # the same rows in another order: the same bucket, replayed (one capture)
    order = torch.tensor([4, 2, 0, 3, 1])
    again = graphs(None, logits[order].to(dev), [table[order], greedy[order.to(dev)]])
    assert torch.equal(again, eager[order.to(dev)])
    assert len(graphs.graphs) == 1
    # the last 3 of them alone: a smaller bucket (its own capture), the same draws
    fewer = graphs(None, logits[2:].to(dev), [table[2:], greedy[2:]])
    assert torch.equal(fewer, eager[2:])
    assert len(graphs.graphs) == len({bucket_for(n, graphs.buckets) for n in (5, 3)})


class _StandInGraph:
    """Stand-in for a captured CUDA graph (none on the CPU): replay runs the captured call
    again on the same static buffers and writes its static output, as a replay would."""

    def __init__(self, run) -> None:  # type: ignore[no-untyped-def]
        self.run = run

    def replay(self) -> None:
        self.run()


def test_replays_copy_n_rows_in_and_read_n_rows_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """DrawGraphs' own part (buckets, keys, static buffers shared by buckets, rows in and out)
    on the CPU, the capture replaced by the stand-in above."""

    def capture(self, variant, b, statics):  # type: ignore[no-untyped-def]
        logits, *inputs = (x[:b] for x in statics)
        out = self.draw(variant, logits, *inputs)
        graph = _StandInGraph(lambda: out.copy_(self.draw(variant, logits, *inputs)))
        return draw_graphs.CapturedDraw(graph, logits, inputs, (out,))  # type: ignore[arg-type]

    monkeypatch.setattr(DrawGraphs, "_capture", capture)
    graphs = DrawGraphs(graph_draw, 8, torch.device("cpu"))
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(1))
    rows = [(*sampling_row(SETTINGS[i % 5], request_seed(i)), 40 + i) for i in range(8)]
    table, greedy = step_table(rows), greedy_tokens(logits)
    eager = sample_on_device(logits, table, greedy)
    for n in (5, 3, 8, 1, 5):  # buckets 8, 4, 8, 1, 8: stale rows past n in the shared buffers
        replayed = graphs(None, logits[:n], [table[:n], greedy[:n]])
        assert torch.equal(replayed, eager[:n]), n
    assert sorted(key[1] for key in graphs.graphs) == [1, 4, 8]
    assert len(graphs.statics) == 1  # one set of static inputs for every bucket


def _params(i: int) -> SamplingParams:
    top_k = 40 if i % 2 else 0
    return SamplingParams(
        temperature=1.0, top_k=top_k, top_p=0.9, seed=10 + i, max_tokens=30, ignore_eos=True
    )


def _requests(ids: list[int]) -> list[GenerationRequest]:
    prompts = {i: [(5 * j + i) % 100 + 1 for j in range(7 + 11 * i)] for i in ids}
    return [GenerationRequest(f"r{i}", prompts[i], _params(i)) for i in ids]


def _tokens(engine: Engine, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    out = engine.generate(requests)
    return {rid: [t for e in events for t in e.token_ids] for rid, events in out.items()}


@pytest.mark.gpu
@needs_gpu
def test_seeded_tokens_through_graphs_equal_eager_and_batch_independent() -> None:
    def engine(cuda_graphs: bool) -> Engine:
        config = EngineConfig(
            max_total_tokens=2048, max_batch_size=8, device="cuda", dtype="float32",
            cuda_graphs=cuda_graphs,
        )  # fmt: skip
        return Engine.from_random(TINY, config, seed=3)

    graphed_engine = engine(cuda_graphs=True)
    graphed = _tokens(graphed_engine, _requests([0, 1, 2, 3, 4]))
    head_graphs = graphed_engine.head.graphs
    assert head_graphs is not None and head_graphs.graphs  # the draws replayed graphs
    assert graphed_engine.overlaps_decode  # and the sampled steps went in flight
    assert graphed == _tokens(engine(cuda_graphs=False), _requests([0, 1, 2, 3, 4]))
    for i in range(5):  # each alone: the same tokens as in the batch of five
        alone = _tokens(engine(cuda_graphs=True), _requests([i]))
        assert alone[f"r{i}"] == graphed[f"r{i}"], i


@pytest.mark.gpu
@needs_gpu
def test_warmup_captures_every_bucket_so_serving_captures_none() -> None:
    config = EngineConfig(max_total_tokens=2048, max_batch_size=8, device="cuda")
    engine = Engine.from_random(TINY, config, seed=3)
    engine.warmup()
    graphs = engine.head.graphs
    assert graphs is not None and len(graphs.graphs) == len(graphs.buckets)
    captured = set(graphs.graphs)
    _tokens(engine, _requests([0, 1, 2, 3, 4]))
    assert set(graphs.graphs) == captured  # sampled steps of 1..5 rows replayed warm-up's graphs
