"""Weight sharing on one GPU (a CUDA machine; skipped elsewhere): two replicas of an engine
stage on cuda:0 with `weight_share = "on"`. The follower's weights are its IPC mapping of the
leader's allocation (not its own memory: its torch allocator holds less than the weights),
their values equal the leader's, and both give the same greedy tokens."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from omni_server.compiler.compiler import compile_repository
from tests.fixtures import FIXTURES
from tests.helpers.repo import make_repo
from tests.helpers.runtime import running

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

STAGE = """\
    backend = "model.py:SharedEngine"
    process = "lm"
    terminal = true
    gpu = [0]
    gpu_memory_fraction = 0.2
    [engine]
    max_total_tokens = 4096
    dtype = "bfloat16"
    cuda_graphs = false
    [parameters]
    vocab_size = 32000
    hidden_size = 1024
    intermediate_size = 4096
    num_layers = 8
    num_heads = 16
    num_kv_heads = 4
    max_position_embeddings = 2048
    tie_word_embeddings = false
    """


def _plan(root, share: str):
    repository = f"""\
        [server]
        weight_share = "{share}"
        [models.m]
        entry = "lm"
        tasks = ["chat"]
        [processes.lm]
        num_replicas = 2
        replica_devices = [0, 0]
        """
    make_repo(root, {"lm": STAGE}, repository, {"lm": FIXTURES / "shared_weights.py"})
    return compile_repository(root)


async def test_two_replicas_on_one_gpu_alias_one_copy_of_the_weights(tmp_path):
    plan = _plan(tmp_path / "repo", "on")
    async with running(plan, start_timeout=240) as runtime:
        model = plan.models["m"]
        prompt = {"prompt": [11, 250, 3071, 9, 42], "max_tokens": 16}
        results = await asyncio.gather(
            *(runtime.submit(model, dict(prompt)).result() for _ in range(2))
        )
        by_replica = {r["replica"]: r for r in results}
        leader, follower = by_replica[0], by_replica[1]
        print("leader", leader, "\nfollower", follower)
        weights = leader["weight_bytes"]
        assert weights > 300 << 20  # ~320 MiB of bf16 weights: a copy would show
        assert follower["in_region"] and leader["in_region"]
        assert follower["embed_sum"] == leader["embed_sum"]
        assert len(leader["tokens"]) == 16 and follower["tokens"] == leader["tokens"]
        # the follower's allocator holds its KV cache and workspace, never the weights
        assert follower["memory_allocated"] < weights
        assert leader["memory_allocated"] < weights  # the leader's copy lives in the region


_READER = """
import sys, torch
from omni_transport.regions import CudaRegionView
view = CudaRegionView(sys.argv[1], device=0)
t = view.tensor(int(sys.argv[2]), int(sys.argv[3]), "bfloat16", (1024, 1024))
inside = view.contains(t.data_ptr())
print(float(t.float().sum()), inside, torch.cuda.memory_allocated(), flush=True)
view.close()
"""


def test_a_cuda_region_is_aliased_by_another_process():
    import torch

    from omni_transport.regions import CudaRegion

    name = f"omni-{os.getpid():08x}-w-test-region"
    region = CudaRegion(name, 4 << 20, device=0)
    try:
        value = torch.randn(1024, 1024, device="cuda:0").bfloat16()
        offset, view = region.place(value)
        torch.cuda.synchronize()
        assert region.contains(view.data_ptr()) and torch.equal(view, value)
        run = subprocess.run(
            [sys.executable, "-c", _READER, name, str(offset), str(2 << 20)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        total, inside, allocated = run.stdout.split()
        assert float(total) == pytest.approx(float(value.float().sum()), rel=1e-6, abs=1e-3)
        assert inside == "True" and int(allocated) < (2 << 20)  # aliased, not copied
    finally:
        region.close()
