"""CUDA tensors between two stage processes on one GPU go through CUDA IPC (GPU only)."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers.runtime import running
from tests.runtime.pipelines import _stage, build

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


async def test_cuda_tensors_cross_processes_on_one_gpu_by_ipc(tmp_path):
    stages = {
        "make": _stage("CudaMake", 'next = "check"\ngpu = 0\ngpu_memory_fraction = 0.2\n', "make"),
        "check": _stage(
            "CudaCheck", "terminal = true\ngpu = 0\ngpu_memory_fraction = 0.2\n", "check"
        ),
    }
    plan = build(tmp_path, stages, '[models.m]\nentry = "make"\ntasks = ["speech"]\n')
    async with running(plan) as runtime:
        model = runtime.plan.models["m"]
        n = 1 << 20
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
