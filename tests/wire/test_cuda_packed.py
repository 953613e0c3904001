"""A message that is one CUDA tensor between two processes' wire endpoints (GPU only): it
crosses as a C-encoded one-tensor record, not pickled, and arrives as the tensor (or the dict
of one key) it was; a tensor that requires grad keeps the pickle path."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

PEER = Path(__file__).with_name("cuda_packed_peer.py")


async def test_one_cuda_tensor_crosses_as_a_packed_record():
    from omni_server.wire import Endpoint

    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as run_dir:
        endpoint = Endpoint(Path(run_dir), "pk", "a", 8 << 20, {"b": frozenset({0})})
        endpoint.create_inbound(["b"])
        replies: asyncio.Queue[Any] = asyncio.Queue()
        endpoint.start_receiving(replies.put_nowait, replies.put_nowait)
        child = subprocess.Popen([sys.executable, str(PEER), run_dir])
        try:
            assert await asyncio.wait_for(replies.get(), 120) == {"ready": True}
            x = torch.randn(1000, 33, device="cuda").to(torch.bfloat16)
            y = torch.arange(4096, device="cuda", dtype=torch.int32).view(64, 64)
            g = torch.ones(8, device="cuda", requires_grad=True)
            sent = [({"t": x}, x), (y, y), (y.t(), y.t()), ({"t": g}, g)]
            got = []
            for message, _ in sent:
                endpoint.send_data("b", message)
                got.append(await asyncio.wait_for(replies.get(), 60))
            endpoint.send_data("b", {"stop": True})
            assert await asyncio.to_thread(child.wait, 60) == 0
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            await endpoint.close()
    for (message, tensor), seen in zip(sent, got, strict=True):
        assert seen["keyed"] == isinstance(message, dict)
        assert seen["device"] == "cuda:0" and seen["shape"] == list(tensor.shape)
        assert seen["dtype"] == str(tensor.dtype)
        expected = float(tensor.detach().double().sum())
        assert seen["sum"] == pytest.approx(expected, rel=1e-6, abs=1e-3)
    assert [seen["packed"] for seen in got] == [1, 2, 3, 3]  # the grad tensor: pickled
    assert got[0]["keys"] == ["t"] and got[3]["requires_grad"]
