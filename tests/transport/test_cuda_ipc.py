"""CUDA IPC through the exported pool: two processes on one GPU. Skipped without CUDA (CI);
the CPU-side contract (records, the CudaUnavailable error) is tested everywhere."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from omni_transport import Ring
from omni_transport.cabi import ffi, lib
from omni_transport.cuda_ipc import (
    BadTensorRecord,
    CudaPool,
    CudaReceiver,
    CudaUnavailable,
    PoolClosed,
    PoolFull,
    PoolSegment,
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


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"{}",
        b'["p", -1, 0, 4, "float32", [1]]',
        b'["p", 0, 0, 4, "float32", [1.5]]',
        b'["p", 0, 0, 4, 7, [1]]',
        b'["p", 0, 0, 4, "float32", 1]',
        b'["p", true, 0, 4, "float32", [1]]',
    ],
)
def test_malformed_tensor_records_are_refused(raw):
    with pytest.raises(BadTensorRecord):
        TensorRecord.from_bytes(raw)


def pool_segment(name: str, nbytes: int, slots: int, room: int | None = None) -> object:
    """A pool's shared segment as CudaPool lays it out (no GPU: no memory handle)."""
    out = ffi.new("omni_segment **")
    assert lib.omni_segment_create(name.encode(), room or PoolSegment.size(slots), out) == 0
    base = lib.omni_segment_data(out[0])
    ffi.cast("uint64_t *", base + 64)[0] = nbytes
    ffi.cast("uint32_t *", base + 72)[0:2] = [0, slots]
    return out[0]


def test_pool_geometry_is_checked_against_its_segment(ring_name):
    seg = pool_segment(ring_name(), 1 << 20, slots=1 << 20, room=4096)  # slots beyond the segment
    try:
        with pytest.raises(BadTensorRecord, match="cannot hold"):
            PoolSegment(seg)
    finally:
        lib.omni_segment_close(seg)
    seg = pool_segment(ring_name(), 1000, slots=4)  # not a multiple of 512
    try:
        with pytest.raises(BadTensorRecord, match="not a positive multiple"):
            PoolSegment(seg)
    finally:
        lib.omni_segment_close(seg)


@pytest.mark.parametrize(
    ("slot", "offset", "nbytes", "dtype", "shape", "message"),
    [
        (4, 0, 16, "float32", (4,), "slot 4 of 4"),
        (0, 100, 16, "float32", (4,), "not a block"),  # not 512-aligned
        (0, 1 << 20, 16, "float32", (4,), "not a block"),  # past the end
        (0, (1 << 20) - 512, 1024, "uint8", (1024,), "not a block"),  # runs past the end
        (0, 0, 16, "cuda", (4,), "not a tensor dtype"),  # a torch attribute, not a dtype
        (0, 0, 16, "float32", (5,), "not 16 bytes"),  # shape reads past nbytes
    ],
)
def test_a_record_must_describe_a_block_of_its_pool(
    ring_name, slot, offset, nbytes, dtype, shape, message
):
    seg = pool_segment(ring_name(), 1 << 20, slots=4)
    try:
        shared = PoolSegment(seg)
        shared.check(TensorRecord("p", 0, 512, 16, "float32", (2, 2)))  # a good one passes
        with pytest.raises(BadTensorRecord, match=message):
            shared.check(TensorRecord("p", slot, offset, nbytes, dtype, shape))
    finally:
        lib.omni_segment_close(seg)


OPENER = """
import sys
from omni_transport.cabi import ffi, lib
out = ffi.new("omni_segment **")
assert lib.omni_segment_attach(sys.argv[1].encode(), out) == 0
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_consumer_that_died_holding_blocks_is_seen(ring_name):
    name = ring_name()
    seg = pool_segment(name, 1 << 20, slots=4)
    shared = PoolSegment(seg)
    consumers = [
        subprocess.Popen(
            [sys.executable, "-c", OPENER, name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        assert not shared.consumer_gone()  # none came yet: nothing to judge
        for proc in consumers:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert not shared.consumer_gone()
        consumers[0].kill()
        consumers[0].wait(10)
        assert not shared.consumer_gone()  # one died, one lives: blocks may still come back
        consumers[1].kill()
        consumers[1].wait(10)
        assert shared.consumer_gone()
    finally:
        for proc in consumers:
            proc.kill()
            proc.communicate(timeout=10)
        lib.omni_segment_close(seg)


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
        assert ask(b"release") == {"released": 1, "releasing": 0}
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
        assert ask(b"release") == {"released": 2, "releasing": 0}
        assert pool.reap() == 2

        # 5. released without waiting (the runtime's way): pending until the consumer's stream
        # passed it, then the block comes back like any other
        v = pool.empty((256, 1024), torch.float32)
        v.fill_(3.0)
        send_tensor(to_peer, pool, v)
        assert ask()["sum"] == 3.0 * 256 * 1024
        assert ask(b"release-later") == {"released": 1, "releasing": 1}
        assert pool.reap() == 1 and pool.in_flight == 0
        to_peer.push(b"stop")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        to_peer.close()
        from_peer.close()
        pool.close()


@pytest.mark.gpu
@gpu
@pytest.mark.timeout(180)
def test_waiting_for_blocks_ends_when_their_consumer_dies(ring_name):
    import torch

    mib = 1 << 20
    pool = CudaPool(ring_name(), 8 * mib)
    to_peer = Ring.create(ring_name(), mib, role="producer")
    from_peer = Ring.create(ring_name(), mib, role="consumer")
    proc = subprocess.Popen([sys.executable, str(PEER), to_peer.name, from_peer.name])
    try:
        x = pool.empty((1024, 1024), torch.float32)  # 4 MiB of 8
        send_tensor(to_peer, pool, x)
        with from_peer.pop(timeout=120) as rec:
            assert json.loads(bytes(rec.header))["shape"] == [1024, 1024]  # it holds the block
        proc.kill()
        proc.wait(30)
        with pytest.raises(PoolClosed, match="died or left"):
            pool.empty((6 * mib,), torch.uint8, timeout=None)  # waited forever before
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        to_peer.close()
        from_peer.close()
        pool.close()


def _reap_until(pool: CudaPool, count: int) -> int:
    """Blocks of packed views come back once the consumer's stream ran their release (a host
    function): look until `count` came back, for a bounded while (no timing is asserted)."""
    import time

    got = 0
    deadline = time.monotonic() + 30
    while got < count and time.monotonic() < deadline:
        got += pool.reap()
        time.sleep(0.001)
    return got


@pytest.mark.gpu
@gpu
@pytest.mark.timeout(180)
def test_a_packed_tensor_crosses_as_the_block_itself_and_returns_when_freed(ring_name):
    import torch

    mib = 1 << 20
    pool = CudaPool(ring_name(), 8 * mib)
    to_peer = Ring.create(ring_name(), mib, role="producer")
    from_peer = Ring.create(ring_name(), mib, role="consumer")
    proc = subprocess.Popen([sys.executable, str(PEER), to_peer.name, from_peer.name])

    def ask(msg: bytes) -> dict:
        to_peer.push(msg)
        with from_peer.pop(timeout=120) as rec:
            return json.loads(bytes(rec.header))

    try:
        # a tensor from outside the pool, written by a kernel still in flight: copied into a
        # block on our stream, the consumer's stream waits on the slot's event
        x = torch.randn(512, 1024, device="cuda").to(torch.bfloat16)
        record = pool.export_packed(x, "frames")
        assert len(record) < 400 and record[:4] == b"OTR1"
        seen = ask(record)
        assert seen["key"] == "frames" and seen["dtype"] == "bfloat16"
        assert seen["shape"] == [512, 1024]
        assert seen["sum"] == pytest.approx(float(x.double().sum()), rel=1e-9, abs=1e-6)
        first_offset = seen["offset_seen"]

        # the same bytes again (a replay): the block is opened already, refused
        assert "not in flight" in ask(record)["error"]

        # a bare tensor made in the pool (no copy); the first block is still held
        y = pool.empty((256, 256), torch.float32)
        y.fill_(1.5)
        seen = ask(pool.export_packed(y))
        assert seen["key"] is None and seen["sum"] == 1.5 * 256 * 256
        assert seen["offset_seen"] != first_offset
        assert pool.reap() == 0 and pool.in_flight == 2  # both views alive over there

        # freed over there: both blocks come back, and the first block is handed out again
        assert ask(b"drop-views") == {"dropped": 2}
        assert _reap_until(pool, 2) == 2 and pool.in_flight == 0
        z = torch.full((512, 1024), 3.0, device="cuda", dtype=torch.bfloat16)
        seen = ask(pool.export_packed(z, "frames"))
        assert seen["sum"] == 3.0 * 512 * 1024 and seen["offset_seen"] == first_offset
        assert ask(b"drop-views") == {"dropped": 1}
        assert _reap_until(pool, 1) == 1
        to_peer.push(b"stop")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        to_peer.close()
        from_peer.close()
        pool.close()
