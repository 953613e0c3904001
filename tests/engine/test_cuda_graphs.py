"""CUDA-graph decode: bucket arithmetic here; graph replay == eager on a GPU (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from omni_server.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from omni_server.engine.cuda_graphs import batch_buckets, bucket_for, context_buckets
from tests.engine.conftest import TINY


def test_buckets() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(3) == [1, 2, 3]
    assert context_buckets(2048) == [256, 512, 1024, 2048]
    assert context_buckets(300) == [256, 300]
    assert bucket_for(9, batch_buckets(64)) == 16
    with pytest.raises(ValueError, match="exceeds"):
        bucket_for(65, batch_buckets(64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_decode_equals_eager_on_gpu() -> None:
    def run(cuda_graphs: bool) -> dict[str, list[int]]:
        config = EngineConfig(
            max_total_tokens=2048,
            max_batch_size=8,
            device="cuda",
            dtype="float32",
            cuda_graphs=cuda_graphs,
        )
        engine = Engine.from_random(TINY, config, seed=3)
        requests = [
            GenerationRequest(
                f"r{i}",
                [(5 * j + i) % 100 + 1 for j in range(7 + 11 * i)],
                SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True),
            )
            for i in range(5)
        ]
        out = engine.generate(requests)
        if cuda_graphs:
            assert engine.runner.graphs is not None and engine.runner.graphs.graphs
        return {rid: [t for e in events for t in e.token_ids] for rid, events in out.items()}

    assert run(cuda_graphs=True) == run(cuda_graphs=False)
