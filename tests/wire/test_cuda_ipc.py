"""The CUDA data path between stages (GPU only): across processes on one GPU a tensor crosses
as a CUDA IPC record (its bytes never cross the host), inside one process it is passed as is."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers.pipelines import build, stage_toml
from tests.helpers.repo import toml
from tests.helpers.runtime import running

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def _pipeline(tmp_path, make_process: str, check_process: str):
    stages = {
        "make": stage_toml(
            "CudaMake",
            toml("""
                next = "check"
                gpu = 0
                gpu_memory_fraction = 0.2
            """),
            make_process,
        ),
        "check": stage_toml(
            "CudaCheck",
            toml("""
                terminal = true
                gpu = 0
                gpu_memory_fraction = 0.2
            """),
            check_process,
        ),
    }
    return build(
        tmp_path,
        stages,
        toml("""
            [models.m]
            entry = "make"
            tasks = ["speech"]
        """),
    )


async def test_cuda_tensors_cross_processes_on_one_gpu_by_ipc(tmp_path):
    plan = _pipeline(tmp_path, "make", "check")
    async with running(plan) as runtime:
        model = runtime.plan.models["m"]
        n = 1 << 20  # 4 MiB of float32 per tensor
        results = await asyncio.gather(
            *(runtime.submit(model, {"n": n, "i": i}).result() for i in range(16))
        )
    for i, result in enumerate(results):
        assert result["device"] == "cuda:0"  # arrived on the GPU, in the other process
        assert result["sum"] == pytest.approx(i * n * (n - 1) / 2, rel=1e-5)
        # the terminal's CUDA tensor reached the server through the host, on the CPU
        assert result["t"].device.type == "cpu"
        assert torch.equal(result["t"], torch.arange(n, dtype=torch.float32) * i * 2)
    assert max(r["ipc_received"] for r in results) == 16  # every one crossed by CUDA IPC
    assert not any(r["same_tensor"] for r in results)  # another process: its own copy
    # no host copy: 16 x 4 MiB crossed, but the check stage's process received only the
    # messages' small headers (IPC records) through its rings, and nothing as spills
    received = max(r["ring_bytes"] for r in results)
    assert received < 16 * 4096, received
    assert max(r["spill_bytes"] for r in results) == 0


async def test_cuda_tensors_inside_one_process_are_passed_as_they_are(tmp_path):
    plan = _pipeline(tmp_path, "gpu", "gpu")
    async with running(plan) as runtime:
        model = runtime.plan.models["m"]
        n = 1 << 20
        results = await asyncio.gather(
            *(runtime.submit(model, {"n": n, "i": i}).result() for i in range(4))
        )
    for i, result in enumerate(results):
        assert result["device"] == "cuda:0"
        assert result["same_tensor"]  # the object CudaMake returned: no copy at all
        assert result["sum"] == pytest.approx(i * n * (n - 1) / 2, rel=1e-5)
    assert max(r["ipc_received"] for r in results) == 0
