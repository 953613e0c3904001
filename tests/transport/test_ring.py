"""Deterministic tests of the shared-memory ring: framing, wraparound at every boundary, full
ring, oversize, empty and multi-buffer records, timeouts, roles, close, peer death, asyncio."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from omni_transport import (
    RecordTooLarge,
    Ring,
    RingClosed,
    RingError,
    RingFull,
    RingTimeout,
    SegmentRefused,
    push_arrays,
    record_arrays,
    unlink_leftovers,
)

pytestmark = pytest.mark.timeout(60)

PAGE = os.sysconf("SC_PAGESIZE")
FRAME = 24  # fixed part of a record: size, header_len, nbufs + magic (see docs/transport.md)


def record_size(header_len: int, lens: list[int]) -> int:
    def up(v: int) -> int:
        return (v + 63) // 64 * 64

    return up(FRAME + 8 * len(lens) + header_len) + sum(up(n) for n in lens)


@pytest.fixture
def pair(ring_name):
    """(producer, consumer) handles of one ring in this process."""
    producer = Ring.create(ring_name(), PAGE, role="producer")
    consumer = Ring.attach(producer.name, role="consumer")
    yield producer, consumer
    consumer.close()
    producer.close()


def test_round_trip_header_and_buffers(no_fd_leak, pair):
    producer, consumer = pair
    producer.push(b"hello", [b"abc", bytearray(b"xyz!"), np.arange(5, dtype=np.int32)])
    with consumer.pop(timeout=5) as rec:
        assert bytes(rec.header) == b"hello"
        assert [bytes(b) for b in rec.buffers[:2]] == [b"abc", b"xyz!"]
        assert np.frombuffer(rec.buffers[2], np.int32).tolist() == [0, 1, 2, 3, 4]
        assert rec.header.readonly and all(b.readonly for b in rec.buffers)
    assert rec.released


def test_capacity_rounds_up_to_power_of_two_pages(ring_name):
    with Ring.create(ring_name(), PAGE + 1) as ring:
        assert ring.capacity == 2 * PAGE
    with Ring.create(ring_name(), 1) as ring:
        assert ring.capacity == PAGE


def test_segment_is_private_and_unlinked_by_last_close(ring_name):
    name = ring_name()
    a = Ring.create(name, PAGE)
    b = Ring.attach(name)
    path = Path("/dev/shm", name)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    a.close()
    assert path.exists()  # b still uses it
    b.close()
    assert not path.exists()


def test_wraparound_at_every_boundary(pair):
    """A record starts at every 64-byte offset of the data area, so its end crosses the end of
    the area at every offset (and one record starts exactly on it): contents survive, and the
    read side sees each record contiguous."""
    producer, consumer = pair
    rng = np.random.default_rng(1)
    pos = 0  # the ring position modulo the capacity, tracked from the record sizes
    for start in range(0, PAGE, 64):
        gap = (start - pos) % PAGE
        if gap:  # a filler record moves the head to `start` (the smallest record is 64 B)
            producer.push(b"", [bytes(gap - 64)] if gap > 64 else [])
            consumer.pop(timeout=5).release()
        payload = rng.integers(0, 256, 3 * PAGE // 4 - 128, dtype=np.uint8)
        producer.push(b"h" * 7, [payload])
        with consumer.pop(timeout=5) as rec:
            assert bytes(rec.header) == b"h" * 7
            assert np.array_equal(np.frombuffer(rec.buffers[0], np.uint8), payload)
        pos = (start + record_size(7, [payload.nbytes])) % PAGE


def test_full_ring_pushes_back_and_frees_on_release(pair):
    producer, consumer = pair
    size = record_size(0, [1000])  # 1088: three fit in a page, a fourth does not
    for _ in range(PAGE // size):
        producer.push(b"", [bytes(1000)], timeout=0)
    with pytest.raises(RingFull):
        producer.push(b"", [bytes(1000)], timeout=0)
    with pytest.raises(RingTimeout):
        producer.push(b"", [bytes(1000)], timeout=0.05)
    first = consumer.pop(timeout=5)
    second = consumer.pop(timeout=5)
    second.release()  # out of order: nothing returns until the older record is released
    with pytest.raises(RingFull):
        producer.push(b"", [bytes(1000)], timeout=0)
    assert consumer.held == 1
    first.release()
    producer.push(b"", [bytes(1000)], timeout=0)
    producer.push(b"", [bytes(1000)], timeout=0)
    assert consumer.held == 0


def test_blocked_push_wakes_when_consumer_releases(no_fd_leak, pair):
    producer, consumer = pair
    producer.spin_us = 0  # go straight to sleep: the release must ring the doorbell
    while True:
        try:
            producer.push(b"", [bytes(500)], timeout=0)
        except RingFull:
            break
    done = threading.Event()

    def push_blocked() -> None:
        producer.push(b"last", [bytes(500)], timeout=10)
        done.set()

    t = threading.Thread(target=push_blocked)
    t.start()
    assert not done.wait(0.1)
    consumer.pop(timeout=5).release()
    t.join(10)
    assert done.is_set()


def test_oversize_record_is_refused(pair):
    producer, consumer = pair
    with pytest.raises(RecordTooLarge, match="exceeds the ring capacity"):
        producer.push(b"", [bytes(PAGE)])
    exact = PAGE - record_size(0, [])  # header part is one 64-byte line
    assert record_size(0, [exact]) == PAGE
    producer.push(b"", [bytes(exact)], timeout=0)  # a record of exactly the capacity fits
    with consumer.pop(timeout=5) as rec:
        assert rec.buffers[0].nbytes == exact


def test_empty_records_and_empty_buffers(pair):
    producer, consumer = pair
    producer.push(b"")
    producer.push(b"", [b"", b"", b"x", b""])
    with consumer.pop(timeout=5) as rec:
        assert bytes(rec.header) == b"" and rec.buffers == []
    with consumer.pop(timeout=5) as rec:
        assert [bytes(b) for b in rec.buffers] == [b"", b"", b"x", b""]


def test_multi_buffer_arrays_are_zero_copy_and_aligned(ring_name):
    with Ring.create(ring_name(), 1 << 20) as producer, Ring.attach(producer.name) as consumer:
        arrays = [
            np.arange(12, dtype=np.float64).reshape(3, 4),
            np.arange(30, dtype=np.int16).reshape(5, 6)[:, ::2],  # not contiguous
            np.zeros((0, 3), np.float32),
            np.array([True, False]),
            np.arange(7, dtype=np.complex64),
        ]
        push_arrays(producer, b"meta", arrays)
        with consumer.pop(timeout=5) as rec:
            got = record_arrays(rec)
            assert bytes(rec.header) == b"meta"
            for want, have in zip(arrays, got, strict=True):
                assert have.dtype == want.dtype and have.shape == want.shape
                assert np.array_equal(have, want)
                assert have.ctypes.data % 64 == 0
                assert not have.flags.writeable
            # the views point into the ring, not into a copy
            assert got[0].ctypes.data == np.frombuffer(rec.buffers[1], np.uint8).ctypes.data


def test_pop_timeout_and_try_pop(pair):
    producer, consumer = pair
    assert consumer.try_pop() is None
    with pytest.raises(RingTimeout):
        consumer.pop(timeout=0.05)
    producer.push(b"a")
    rec = consumer.try_pop()
    assert rec is not None and bytes(rec.header) == b"a"
    rec.release()


def test_producer_close_drains_then_closed(pair):
    producer, consumer = pair
    producer.push(b"1")
    producer.push(b"2")
    producer.close()
    assert bytes(consumer.pop(timeout=5).header) == b"1"
    assert bytes(consumer.pop(timeout=5).header) == b"2"
    with pytest.raises(RingClosed):
        consumer.pop(timeout=5)
    with pytest.raises(RingClosed):
        consumer.try_pop()


def test_consumer_close_fails_push(pair):
    producer, consumer = pair
    consumer.close()
    with pytest.raises(RingClosed):
        producer.push(b"x")


def test_blocked_pop_sees_close_from_another_thread(pair):
    producer, consumer = pair
    consumer.spin_us = 0
    result: list[BaseException] = []

    def pop() -> None:
        try:
            consumer.pop(timeout=10)
        except RingClosed as e:
            result.append(e)

    t = threading.Thread(target=pop)
    t.start()
    producer.close()
    t.join(10)
    assert len(result) == 1


def test_one_producer_one_consumer(ring_name):
    with Ring.create(ring_name(), PAGE) as a, Ring.attach(a.name) as b:
        a.push(b"x")
        with pytest.raises(RingError, match="already is its producer"):
            b.push(b"y")
        with pytest.raises(RingError, match="this handle is the producer"):
            a.pop(timeout=0)


def test_bad_names_and_missing_rings(ring_name):
    with pytest.raises(RingError, match="segment name"):
        Ring.create("bad/name")
    with pytest.raises(RingError, match="No such file"):
        Ring.attach(ring_name())
    with Ring.create(ring_name(), PAGE) as ring, pytest.raises(RingError, match="File exists"):
        Ring.create(ring.name, PAGE)
    with pytest.raises(ValueError, match="timeout"):
        Ring.create(ring_name(), PAGE, role="consumer").pop(timeout=-1)


def test_closed_handle_refuses_use(ring_name):
    ring = Ring.create(ring_name(), PAGE)
    ring.close()
    ring.close()  # idempotent
    with pytest.raises(RingError, match="is closed"):
        ring.push(b"x")


def test_no_fd_leak_over_many_rings(ring_name, no_fd_leak):
    for _ in range(50):
        a = Ring.create(ring_name(), PAGE)
        b = Ring.attach(a.name)
        a.push(b"x", [b"y"])
        b.pop(timeout=5).release()
        a.close()
        b.close()


# ---- asyncio ----


async def test_pop_async_waits_on_doorbell(pair):
    producer, consumer = pair

    async def later() -> None:
        await asyncio.sleep(0.05)
        producer.push(b"late", [b"payload"])

    task = asyncio.create_task(later())
    with await asyncio.wait_for(consumer.pop_async(), 10) as rec:
        assert bytes(rec.header) == b"late"
        assert bytes(rec.buffers[0]) == b"payload"
    await task
    producer.push(b"ready")  # already there: no waiting
    with await asyncio.wait_for(consumer.pop_async(), 10) as rec:
        assert bytes(rec.header) == b"ready"


async def test_pop_async_many_rings_one_loop(ring_name):
    pairs = []
    for _ in range(4):
        p = Ring.create(ring_name(), PAGE, role="producer")
        pairs.append((p, Ring.attach(p.name, role="consumer")))
    try:
        waits = [asyncio.create_task(c.pop_async()) for _, c in pairs]
        await asyncio.sleep(0.02)
        for i, (p, _) in enumerate(reversed(pairs)):
            p.push(str(i).encode())
        recs = await asyncio.wait_for(asyncio.gather(*waits), 10)
        assert [bytes(r.header) for r in recs] == [b"3", b"2", b"1", b"0"]
        for r in recs:
            r.release()
    finally:
        for p, c in pairs:
            c.close()
            p.close()


async def test_pop_async_closed_and_cancelled(pair):
    producer, consumer = pair
    task = asyncio.create_task(consumer.pop_async())
    await asyncio.sleep(0.02)
    task.cancel()  # leaves no reader behind: the next wait works
    with pytest.raises(asyncio.CancelledError):
        await task
    wait = asyncio.create_task(consumer.pop_async())
    await asyncio.sleep(0.02)
    producer.close()
    with pytest.raises(RingClosed):
        await asyncio.wait_for(wait, 10)


# ---- peers in other processes ----

HOLDER = """
import sys, time
from omni_transport import Ring
ring = Ring.attach(sys.argv[1], role=sys.argv[2])
print("ready", flush=True)
time.sleep(60)
"""


def start_holder(name: str, role: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, name, role], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    if proc.stdout:
        proc.stdout.close()


def test_blocked_pop_returns_when_producer_dies(ring_name, no_fd_leak):
    consumer = Ring.create(ring_name(), PAGE, role="consumer", spin_us=0)
    proc = start_holder(consumer.name, "producer")
    try:
        threading.Timer(0.1, lambda: proc.send_signal(signal.SIGKILL)).start()
        with pytest.raises(RingClosed, match="closed the ring or died"):
            consumer.pop(timeout=20)
    finally:
        kill(proc)
        consumer.close()


def test_blocked_push_returns_when_consumer_dies(ring_name, no_fd_leak):
    producer = Ring.create(ring_name(), PAGE, role="producer", spin_us=0)
    proc = start_holder(producer.name, "consumer")
    try:
        while True:
            try:
                producer.push(b"", [bytes(900)], timeout=0)
            except RingFull:
                break
        threading.Timer(0.1, lambda: proc.send_signal(signal.SIGKILL)).start()
        with pytest.raises(RingClosed):
            producer.push(b"", [bytes(900)], timeout=20)
    finally:
        kill(proc)
        producer.close()


async def test_pop_async_sees_producer_death(ring_name):
    consumer = Ring.create(ring_name(), PAGE, role="consumer")
    proc = start_holder(consumer.name, "producer")
    try:
        asyncio.get_running_loop().call_later(0.1, proc.send_signal, signal.SIGKILL)
        with pytest.raises(RingClosed):
            await asyncio.wait_for(consumer.pop_async(), 20)
    finally:
        kill(proc)
        consumer.close()


def test_unlink_leftovers_removes_only_dead_segments(ring_name):
    live = Ring.create(ring_name(), PAGE)
    dead_name = ring_name()
    script = (
        "import os, sys\nfrom omni_transport import Ring\n"
        "ring = Ring.create(sys.argv[1], 4096)\nos.kill(os.getpid(), 9)"
    )
    proc = subprocess.run([sys.executable, "-c", script, dead_name], check=False)
    assert proc.returncode == -signal.SIGKILL
    assert Path("/dev/shm", dead_name).exists()
    prefix = dead_name.rsplit("-", 1)[0] + "-"
    assert unlink_leftovers(prefix) == [dead_name]
    assert not Path("/dev/shm", dead_name).exists()
    assert Path("/dev/shm", live.name).exists()
    live.close()
    with pytest.raises(RingError, match="prefix"):
        unlink_leftovers("")


def test_attach_refuses_a_segment_that_is_not_a_ring(ring_name):
    from omni_transport.cabi import ffi, lib

    name = ring_name()
    out = ffi.new("omni_segment **")
    assert lib.omni_segment_create(name.encode(), 4096, out) == lib.OMNI_OK
    try:
        with pytest.raises(SegmentRefused, match="kind 1, expected version 2 kind 2"):
            Ring.attach(name)
    finally:
        lib.omni_segment_close(out[0])


def test_header_may_be_any_buffer(pair):
    producer, consumer = pair
    producer.push(memoryview(b"xyz"), [bytearray(b"1")])
    producer.push(np.frombuffer(b"abcd", np.uint8))
    assert bytes(consumer.pop(timeout=5).header) == b"xyz"
    assert bytes(consumer.pop(timeout=5).header) == b"abcd"


async def test_push_async_waits_for_room(pair):
    producer, consumer = pair
    while True:
        try:
            producer.push(b"", [bytes(900)], timeout=0)
        except RingFull:
            break
    pushed = asyncio.create_task(producer.push_async(b"last", [bytes(900)]))
    await asyncio.sleep(0.05)
    assert not pushed.done()  # the ring is full: the loop keeps running, the push waits
    consumer.pop(timeout=5).release()  # the release rings the producer's doorbell
    await asyncio.wait_for(pushed, 10)
    headers = []
    while (rec := consumer.try_pop()) is not None:
        headers.append(bytes(rec.header))
        rec.release()
    assert headers[-1] == b"last"


async def test_push_async_sees_consumer_death(ring_name):
    producer = Ring.create(ring_name(), PAGE, role="producer")
    proc = start_holder(producer.name, "consumer")
    try:
        while True:
            try:
                producer.push(b"", [bytes(900)], timeout=0)
            except RingFull:
                break
        asyncio.get_running_loop().call_later(0.1, proc.send_signal, signal.SIGKILL)
        with pytest.raises(RingClosed):
            await asyncio.wait_for(producer.push_async(b"", [bytes(900)]), 20)
    finally:
        kill(proc)
        producer.close()


def test_close_with_live_views_keeps_them_readable(ring_name):
    """Views outliving close() must not crash the process (the mapping is kept for them); a
    subprocess, so that a regression is a failed test rather than a dead test runner."""
    script = """
import sys
import numpy as np
from omni_transport import Ring
producer = Ring.create(sys.argv[1], 1 << 16)
consumer = Ring.attach(sys.argv[1])
producer.push(b"h", [np.arange(1000)])
rec = consumer.pop(timeout=5)
array = np.frombuffer(rec.buffers[0], np.int64)
consumer.close()
producer.close()
print(int(array.sum()), bytes(rec.header).decode())
"""
    out = subprocess.run(
        [sys.executable, "-c", script, ring_name()], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(sum(range(1000))), "h"]


@pytest.mark.parametrize("hot_spin_us", [0.0, 500.0, None])
async def test_pop_async_on_a_hot_stream_gets_every_record_in_order(pair, hot_spin_us):
    """A thread pushes records a few hundred microseconds apart: with the hot-stream poll
    fixed (records come while it polls), off (each wait sleeps on the doorbell) and adaptive
    (None), every record arrives once, in order; and a poll that finds nothing still ends in
    the doorbell wait."""
    import threading
    import time

    producer, consumer = pair
    consumer.hot_spin_us = hot_spin_us
    assert consumer.hot_spin_us == hot_spin_us

    def push_all() -> None:
        for i in range(200):
            producer.push(str(i).encode())
            time.sleep(0.0002)

    thread = threading.Thread(target=push_all)
    thread.start()
    got = []
    for _ in range(200):
        with await asyncio.wait_for(consumer.pop_async(), 10) as rec:
            got.append(int(bytes(rec.header)))
    thread.join()
    assert got == list(range(200))

    async def later() -> None:
        await asyncio.sleep(0.05)  # past any spin: the consumer sleeps on the doorbell
        producer.push(b"late")

    task = asyncio.create_task(later())
    with await asyncio.wait_for(consumer.pop_async(), 10) as rec:
        assert bytes(rec.header) == b"late"
    await task


def test_hot_spin_is_bounded(pair):
    _, consumer = pair
    for bad in (-1.0, 1e5, float("nan")):
        with pytest.raises(ValueError, match="hot_spin_us"):
            consumer.hot_spin_us = bad
        with pytest.raises(ValueError, match="hot_poll_max_us"):
            consumer.hot_poll_max_us = bad


def test_the_poll_is_adaptive_unless_fixed(ring_name, monkeypatch):
    """Without OMNI_RING_HOT_SPIN_US a ring learns its poll (a fresh one polls 200 us, the old
    fixed default); the variable fixes it, OMNI_RING_HOT_POLL_MAX_US sets the adaptive cap."""
    monkeypatch.delenv("OMNI_RING_HOT_SPIN_US", raising=False)
    monkeypatch.delenv("OMNI_RING_HOT_POLL_MAX_US", raising=False)
    with Ring.create(ring_name(), PAGE, role="consumer") as ring:
        assert ring.hot_spin_us is None
        assert ring.hot_poll_max_us == 1000
        assert ring.hot_poll_us == pytest.approx(199.5)
    monkeypatch.setenv("OMNI_RING_HOT_SPIN_US", "300")
    monkeypatch.setenv("OMNI_RING_HOT_POLL_MAX_US", "1500")
    with Ring.create(ring_name(), PAGE, role="consumer") as ring:
        assert ring.hot_spin_us == 300
        assert ring.hot_poll_max_us == 1500
        assert ring.hot_poll_us == 0  # fixed: only within 2 ms of a record (none yet)
        ring.hot_spin_us = None
        assert ring.hot_poll_us == pytest.approx(199.5)


async def test_a_busy_stream_polls_briefly_a_fixed_poll_only_after_a_record(pair):
    """Records that are already there when popped teach the ring that its waits are short:
    its poll shrinks to the floor (50 us). A fixed poll runs within 2 ms of a record only."""
    import time

    producer, consumer = pair
    consumer.hot_spin_us = None
    for i in range(30):
        producer.push(b"%d" % i)
    for _ in range(30):
        with await asyncio.wait_for(consumer.pop_async(), 10):
            pass
    assert consumer.typical_wait_us < 1
    assert consumer.hot_poll_us == 50
    consumer.hot_spin_us = 300
    assert consumer.hot_poll_us == 300  # a record came just now
    time.sleep(0.003)
    assert consumer.hot_poll_us == 0


@contextlib.contextmanager
def _loop_readers() -> Iterator[list[int]]:
    """The fds added to the running loop's readers inside the block (a pop that sleeps adds its
    doorbell; one that polls adds none)."""
    loop = asyncio.get_running_loop()
    readers: list[int] = []
    add_reader = loop.add_reader

    def watched(fd: int, *args: object) -> None:
        readers.append(fd)
        add_reader(fd, *args)

    loop.add_reader = watched
    try:
        yield readers
    finally:
        del loop.add_reader


async def _sleeps_at_once(consumer: Ring, producer: Ring) -> bool:
    """Whether a pop that finds the ring empty goes to sleep on its first step (adds the
    doorbell to the loop's readers) instead of polling."""
    with _loop_readers() as readers:
        pop = asyncio.create_task(consumer.pop_async())
        await asyncio.sleep(0)  # the pop's first step: it armed and slept, or it polls
        slept = bool(readers)
        producer.push(b"next")
        with await asyncio.wait_for(pop, 10) as rec:
            assert bytes(rec.header) == b"next"
    return slept


async def test_a_sparse_stream_costs_no_poll(pair):
    """Records 10 ms apart: after the first waits the ring's poll is 0 (its waits exceed the
    cap), so a pop on it sleeps on the doorbell at once and burns nothing; records that come
    a few hundred microseconds apart make it poll again (no reader added)."""
    producer, consumer = pair
    consumer.hot_spin_us = None
    # what the EWMA alone decides: on a loaded machine the contention check could skip polls
    consumer.contention_check = False

    async def every(gap_s: float, n: int) -> None:
        for i in range(n):
            await asyncio.sleep(gap_s)
            producer.push(b"%d" % i)

    task = asyncio.create_task(every(0.01, 4))
    for _ in range(4):
        with await asyncio.wait_for(consumer.pop_async(), 10):
            pass
    await task
    assert consumer.typical_wait_us > 1000
    assert consumer.hot_poll_us == 0
    assert await _sleeps_at_once(consumer, producer)
    for _ in range(20):  # waits of ~0 (the record is there): the EWMA comes down again
        producer.push(b"x")
        with await asyncio.wait_for(consumer.pop_async(), 10):
            pass
    assert 0 < consumer.hot_poll_us <= consumer.hot_poll_max_us
    assert not await _sleeps_at_once(consumer, producer)


async def test_the_hot_poll_leaves_the_loop_to_other_tasks(pair):
    """While a hot stream's pop polls the ring, the loop's other tasks keep running (the poll
    alternates short spins with passes of the loop): a task on the same loop runs while the
    pop waits and pushes the record itself, and the pop takes it from its poll, never having
    gone to sleep on the doorbell (no reader was added to the loop)."""
    producer, consumer = pair
    consumer.hot_spin_us = 10000  # the poll outlasts the few passes below
    producer.push(b"first")
    with await asyncio.wait_for(consumer.pop_async(), 10) as rec:  # the stream is hot now
        assert bytes(rec.header) == b"first"
    with _loop_readers() as readers:
        pop = asyncio.create_task(consumer.pop_async())
        for _ in range(3):  # passes of the loop while the pop polls
            await asyncio.sleep(0)
        assert not pop.done()
        producer.push(b"second")
        with await asyncio.wait_for(pop, 10) as rec:
            assert bytes(rec.header) == b"second"
    assert readers == []
