"""A message that is one CUDA tensor between two processes' wire endpoints (GPU only): it
crosses as a C-encoded one-tensor record, not pickled, and arrives as the tensor (or the dict
of one key) it was; a tensor that requires grad keeps the pickle path."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import tempfile
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def _endpoint(run_dir: str, name: str, peer: str) -> Any:
    from omni_server.wire import Endpoint

    endpoint = Endpoint(Path(run_dir), "pk", name, 8 << 20, {peer: frozenset({0})})
    endpoint.create_inbound([peer])
    return endpoint


async def _receive(run_dir: str, ready: Any) -> None:
    from omni_server.wire import cuda_lane

    torch.cuda.set_device(0)
    endpoint = _endpoint(run_dir, "b", "a")
    done = asyncio.Event()

    def handle(message: Any) -> None:
        if isinstance(message, dict) and message.get("stop"):
            done.set()
            return
        keyed = isinstance(message, dict)
        t = message["t"] if keyed else message
        endpoint.send_data(
            "a",
            {
                "keyed": keyed,
                "keys": sorted(message) if keyed else [],
                "device": str(t.device),
                "dtype": str(t.dtype),
                "shape": list(t.shape),
                "sum": float(t.double().sum()),
                "requires_grad": t.requires_grad,
                "packed": cuda_lane.stats["packed_received"],
            },
        )

    endpoint.start_receiving(handle, lambda _: done.set())
    ready.set()
    await done.wait()
    await endpoint.close()


def _receiver(run_dir: str, ready: Any) -> None:
    asyncio.run(_receive(run_dir, ready))


async def test_one_cuda_tensor_crosses_as_a_packed_record():
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as run_dir:
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        endpoint = _endpoint(run_dir, "a", "b")
        child = ctx.Process(target=_receiver, args=(run_dir, ready), daemon=True)
        child.start()
        replies: asyncio.Queue[Any] = asyncio.Queue()
        endpoint.start_receiving(replies.put_nowait, replies.put_nowait)
        try:
            assert await asyncio.to_thread(ready.wait, 120)
            x = torch.randn(1000, 33, device="cuda").to(torch.bfloat16)
            y = torch.arange(4096, device="cuda", dtype=torch.int32).view(64, 64)
            g = torch.ones(8, device="cuda", requires_grad=True)
            sent = [({"t": x}, x), (y, y), (y.t(), y.t()), ({"t": g}, g)]
            got = []
            for message, _ in sent:
                endpoint.send_data("b", message)
                got.append(await asyncio.wait_for(replies.get(), 60))
            endpoint.send_data("b", {"stop": True})
            await asyncio.to_thread(child.join, 60)
        finally:
            if child.is_alive():
                child.kill()
                child.join()
            await endpoint.close()
    for (message, tensor), seen in zip(sent, got, strict=True):
        assert seen["keyed"] == isinstance(message, dict)
        assert seen["device"] == "cuda:0" and seen["shape"] == list(tensor.shape)
        assert seen["dtype"] == str(tensor.dtype)
        assert seen["sum"] == pytest.approx(float(tensor.double().sum()), rel=1e-6, abs=1e-3)
    assert [seen["packed"] for seen in got] == [1, 2, 3, 3]  # the grad tensor: pickled
    assert got[0]["keys"] == ["t"] and got[3]["requires_grad"]
