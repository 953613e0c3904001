"""CUDA IPC through the exported pool: two processes on one GPU. Skipped without CUDA (CI);
the CPU-side contract (records, the CudaUnavailable error) is tested everywhere."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from omni_transport import Ring
from omni_transport.cuda_ipc import (
    CudaPool,
    CudaReceiver,
    CudaUnavailable,
    PoolFull,
    TensorRecord,
    cuda_available,
    send_tensor,
)

PEER = Path(__file__).with_name("cuda_peer.py")


def _cuda() -> bool:
    if not cuda_available():
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


HAVE_CUDA = _cuda()
gpu = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU and a CUDA build of torch")


def test_tensor_record_round_trips():
    rec = TensorRecord("omni-x-pool", 3, 4096, 24, "bfloat16", (2, 6))
    assert TensorRecord.from_bytes(memoryview(rec.to_bytes())) == rec


@pytest.mark.skipif(HAVE_CUDA, reason="checks the error raised without CUDA")
def test_without_cuda_a_clear_error(ring_name):
    with pytest.raises(CudaUnavailable, match="CUDA unavailable"):
        CudaPool(ring_name(), 1 << 20)
    with pytest.raises(CudaUnavailable, match="CUDA unavailable"):
        CudaReceiver()


@pytest.mark.gpu
@gpu
@pytest.mark.timeout(180)
def test_tensor_crosses_and_block_is_reused_only_after_release(ring_name):
    import torch

    mib = 1 << 20
    pool = CudaPool(ring_name(), 8 * mib)
    to_peer = Ring.create(ring_name(), mib, role="producer")
    from_peer = Ring.create(ring_name(), mib, role="consumer")
    proc = subprocess.Popen([sys.executable, str(PEER), to_peer.name, from_peer.name])

    def ask(msg: bytes | None = None) -> dict:
        if msg is not None:
            to_peer.push(msg)
        with from_peer.pop(timeout=120) as rec:
            return json.loads(bytes(rec.header))

    try:
        # 1. written by a kernel still in flight: the consumer's stream waits on our event
        x = pool.empty((1024, 1024), torch.float32)  # 4 MiB: half the pool
        values = torch.arange(1024 * 1024, dtype=torch.float64).view(1024, 1024) * 0.5
        x.copy_(values.to("cuda", torch.float32), non_blocking=True)
        trec = pool.export(x)
        to_peer.push(trec.to_bytes())
        seen = ask()
        assert seen["dtype"] == "float32" and seen["shape"] == [1024, 1024]
        assert seen["sum"] == pytest.approx(float(values.sum()), rel=1e-12)
        assert seen["first"] == [0.0, 0.5, 1.0, 1.5]
        assert seen["offset_seen"] == trec.offset  # a view of the pool, no copy

        # 2. the consumer holds it: its block is not handed out again
        assert pool.reap() == 0 and pool.in_flight == 1
        y = pool.empty((1024, 1024), torch.float32)
        assert y.data_ptr() != x.data_ptr()
        with pytest.raises(PoolFull):
            pool.empty((16,), torch.float32, timeout=0)

        # 3. released: the same block comes back, and new contents cross through it
        assert ask(b"release") == {"released": 1}
        assert pool.reap() == 1 and pool.in_flight == 0
        z = pool.empty((1024, 1024), torch.float32)
        assert z.data_ptr() == x.data_ptr()
        z.fill_(2.0)
        send_tensor(to_peer, pool, z)
        seen = ask()
        assert seen["sum"] == 2.0 * 1024 * 1024 and seen["offset_seen"] == trec.offset

        # 4. bfloat16, from outside the pool: copied into a block once, then crossed
        pool.free(y)
        w = torch.randn(333, 7, device="cuda").to(torch.bfloat16)
        send_tensor(to_peer, pool, w)
        seen = ask()
        assert seen["dtype"] == "bfloat16" and seen["shape"] == [333, 7]
        assert seen["sum"] == pytest.approx(float(w.double().sum()), rel=1e-9, abs=1e-9)
        assert ask(b"release") == {"released": 2}
        assert pool.reap() == 2
        to_peer.push(b"stop")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        to_peer.close()
        from_peer.close()
        pool.close()
