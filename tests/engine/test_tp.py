"""Tensor parallelism of the engine's Llama: two ranks over gloo (CPU, float32) sample the very
tokens one unsharded engine samples (also with media requests ordered by the ranks' clocks,
made to disagree: they order by rank 0's); shapes the ranks cannot split are refused by name."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from omni_server.engine import SMOLLM2_135M, Engine, EngineConfig
from omni_server.engine.parallel import TensorParallel
from omni_server.engine.sampling import SamplingParams
from omni_server.engine.sequence import GenerationRequest
from tests.fixtures.tp_stages import SPLITTABLE

pytestmark = pytest.mark.timeout(180)

# SPLITTABLE: 8 heads / 4 KV heads / MLP 256 split over 2 ranks (SmolLM2-135M's 9 / 3 does not)
CONFIG = EngineConfig(max_total_tokens=1024, max_batch_size=8, max_step_tokens=64)


def _requests(media: bool = False) -> list[GenerationRequest]:
    """Greedy and seeded-sampled requests; prompts longer than max_step_tokens are chunked.
    media: each token plays 1 s (the playback-aware order applies when a step is full)."""
    return [
        GenerationRequest(
            f"r{i}",
            [(7 * j + 3 * i) % 250 + 1 for j in range(5 + 29 * i)],
            SamplingParams(
                temperature=0.0 if i % 2 == 0 else 0.8, seed=i, max_tokens=12, ignore_eos=True
            ),
            playback_seconds=1.0 if media else None,
        )
        for i in range(4)
    ]


def _tokens(engine: Engine, media: bool = False) -> dict[str, list[int]]:
    out = engine.generate(_requests(media))
    return {rid: [t for e in events for t in e.token_ids] for rid, events in out.items()}


def rank_main(
    rank: int, size: int, port: int, gpu: int = 0, dtype: str = "float32", media: str = ""
) -> None:
    """One rank (a child process): prints its KV heads and tokens as JSON. gpu: NCCL on
    cuda:rank, else gloo on the CPU. media: media requests, 2 rows a step, and rank 1's clock
    running 1000 times as fast as rank 0's (on its own it would find every stream late)."""
    import torch.distributed as dist

    from omni_server.stage.tp import init_process_group

    torch.set_num_threads(1)
    group, control = init_process_group(rank, size, port, rank if gpu else None)
    tp = TensorParallel(rank, size, group)
    config = _config(gpu, dtype, rank)
    if media:
        config = dataclasses.replace(config, max_batch_size=2)
    engine = Engine.from_random(SPLITTABLE, config, seed=5, tp=tp)
    engine.clock = lambda: time.monotonic() * (1 + 999 * rank)  # rank 1's runs 1000x as fast
    tokens = _tokens(engine, bool(media))
    print(json.dumps({"heads": engine.cache.k[0].shape[1], "tokens": tokens}), flush=True)
    dist.barrier(group=control)
    # Tearing a group down can abort() (gloo, the peer gone) or hang (NCCL after graph capture):
    # both ranks are done here, so leave without the teardown.
    os._exit(0)


def _config(gpu: int, dtype: str, rank: int = 0) -> EngineConfig:
    if not gpu:
        return CONFIG
    return dataclasses.replace(CONFIG, device=f"cuda:{rank}", dtype=dtype, cuda_graphs=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_ranks(
    size: int, gpu: int = 0, dtype: str = "float32", media: str = ""
) -> list[dict[str, Any]]:
    port = _free_port()
    code = (
        "import sys; from tests.engine.test_tp import rank_main; "
        "rank_main(*map(int, sys.argv[1:5]), sys.argv[5], sys.argv[6])"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank), str(size), str(port), str(gpu), dtype, media],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(size)
    ]
    try:
        outputs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * size
    return [json.loads(out.strip().splitlines()[-1]) for out in outputs]


@pytest.mark.slow  # two torch processes
def test_tp2_over_gloo_samples_the_tokens_of_tp1() -> None:
    torch.set_num_threads(1)
    expected = _tokens(Engine.from_random(SPLITTABLE, CONFIG, seed=5))
    for rank, got in enumerate(_run_ranks(2)):
        assert got["heads"] == SPLITTABLE.num_kv_heads // 2, f"rank {rank} caches its heads only"
        assert got["tokens"] == expected, f"rank {rank}"
    assert len({t for tokens in expected.values() for t in tokens}) > 4  # not one repeated token


@pytest.mark.slow  # two torch processes
def test_tp2_ranks_order_media_requests_by_rank_0s_clock() -> None:
    """4 media requests, 2 rows a step: the playback-aware order decides who steps by the
    clock, and rank 1's runs 1000x as fast; both read rank 0's, so they build the same batches
    (a mismatch fails the all-reduce) and sample the tokens of one unsharded engine."""
    torch.set_num_threads(1)
    config = dataclasses.replace(CONFIG, max_batch_size=2)
    expected = _tokens(Engine.from_random(SPLITTABLE, config, seed=5), media=True)
    for rank, got in enumerate(_run_ranks(2, media="media")):
        assert got["tokens"] == expected, f"rank {rank}"


@pytest.mark.gpu2
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp2_over_nccl_samples_the_tokens_of_tp1(dtype: str) -> None:
    """NCCL on two GPUs, CUDA graphs on (the all-reduces are captured). float32: every token
    equal; bfloat16 rounds each rank's partial sums, so it reports how many match (and the two
    ranks must still agree with each other)."""
    expected = _tokens(Engine.from_random(SPLITTABLE, _config(1, dtype), seed=5))
    ranks = _run_ranks(2, gpu=1, dtype=dtype)
    assert ranks[0]["tokens"] == ranks[1]["tokens"], "the ranks sampled different tokens"
    got = ranks[0]["tokens"]
    same = sum(a == b for rid in expected for a, b in zip(expected[rid], got[rid], strict=True))
    total = sum(len(t) for t in expected.values())
    print(f"\nTP=2 over NCCL, {dtype}: {same}/{total} tokens equal to TP=1")
    if dtype == "float32":
        assert got == expected


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
