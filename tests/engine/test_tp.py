"""Tensor parallelism of the engine's Llama: two ranks over gloo (CPU, float32) sample the very
tokens one unsharded engine samples; shapes the ranks cannot split are refused by name."""

from __future__ import annotations

import datetime
import json
import socket
import subprocess
import sys

import pytest
import torch

from omni_server.engine import SMOLLM2_135M, Engine, EngineConfig, LlamaShape
from omni_server.engine.parallel import TensorParallel
from omni_server.engine.sampling import SamplingParams
from omni_server.engine.sequence import GenerationRequest

pytestmark = pytest.mark.timeout(180)

# 8 heads / 4 KV heads / MLP 256: splits over 2 ranks (SmolLM2-135M's 9 / 3 does not)
SPLITTABLE = LlamaShape(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
CONFIG = EngineConfig(max_total_tokens=1024, max_batch_size=8, max_step_tokens=64)


def _requests() -> list[GenerationRequest]:
    """Greedy and seeded-sampled requests; prompts longer than max_step_tokens are chunked."""
    return [
        GenerationRequest(
            f"r{i}",
            [(7 * j + 3 * i) % 250 + 1 for j in range(5 + 29 * i)],
            SamplingParams(
                temperature=0.0 if i % 2 == 0 else 0.8, seed=i, max_tokens=12, ignore_eos=True
            ),
        )
        for i in range(4)
    ]


def _tokens(engine: Engine) -> dict[str, list[int]]:
    out = engine.generate(_requests())
    return {rid: [t for e in events for t in e.token_ids] for rid, events in out.items()}


def rank_main(rank: int, size: int, port: int) -> None:
    """One rank (a child process): prints its KV heads and tokens as JSON."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        tp = TensorParallel(rank, size, dist.group.WORLD)
        engine = Engine.from_random(SPLITTABLE, CONFIG, seed=5, tp=tp)
        print(json.dumps({"heads": engine.cache.k[0].shape[1], "tokens": _tokens(engine)}))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow  # two torch processes
def test_tp2_over_gloo_samples_the_tokens_of_tp1() -> None:
    torch.set_num_threads(1)
    expected = _tokens(Engine.from_random(SPLITTABLE, CONFIG, seed=5))
    port = _free_port()
    code = (
        "import sys; from tests.engine.test_tp import rank_main; rank_main(*map(int, sys.argv[1:]))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank), "2", str(port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0]
    for rank, output in enumerate(outputs):
        got = json.loads(output.strip().splitlines()[-1])
        assert got["heads"] == SPLITTABLE.num_kv_heads // 2, f"rank {rank} caches its heads only"
        assert got["tokens"] == expected, f"rank {rank}"
    assert len({t for tokens in expected.values() for t in tokens}) > 4  # not one repeated token


def test_a_shape_the_ranks_cannot_split_is_refused_by_name() -> None:
    tp = TensorParallel(0, 2, group=object())
    with pytest.raises(ValueError, match=r"tp_size = 2 .*num_heads = 9, num_kv_heads = 3"):
        Engine.from_random(SMOLLM2_135M, CONFIG, tp=tp)
    with pytest.raises(ValueError, match="needs a process group"):
        TensorParallel(0, 2)


def test_each_rank_keeps_its_share_of_every_fused_segment() -> None:
    full = torch.arange(12.0).unsqueeze(1).expand(12, 3)  # rows: Q 0-5 | K 6-8 | V 9-11 ... per 2
    q_k_v = (6, 2, 4)
    rank0 = TensorParallel(0, 2, group=object()).rows(full, q_k_v)[:, 0].tolist()
    rank1 = TensorParallel(1, 2, group=object()).rows(full, q_k_v)[:, 0].tolist()
    assert rank0 == [0, 1, 2, 6, 8, 9]
    assert rank1 == [3, 4, 5, 7, 10, 11]
    cols = torch.arange(8.0).view(2, 4)
    assert TensorParallel(1, 2, group=object()).columns(cols).tolist() == [[2, 3], [6, 7]]
