"""The consumer against arbitrary shared-memory contents: whatever another process writes into the
ring (counters, record framing, lengths), a pop returns exactly the record a reference parser of
the documented layout finds, or refuses it with RingCorrupt; never a crash or a view outside the
ring. Bounded in time (hypothesis, a fixed number of examples, no deadline per example)."""

from __future__ import annotations

import mmap
import os
import random
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")  # a test dependency; a bare GPU machine may lack it

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from omni_transport import Ring, RingCorrupt

pytestmark = pytest.mark.timeout(120)

PAGE = os.sysconf("SC_PAGESIZE")
CAP = PAGE  # the smallest ring: garbage lengths reach past it most often
# documented layout (docs/transport.md): ring control at 256, one 64-byte line per side
PRODUCER_POS = 256 + 64
CONSUMER_POS = 256 + 128
DATA = PAGE
MAGIC = 0x31434552
U64 = (1 << 64) - 1


def up(v: int) -> int:
    return (v + 63) // 64 * 64


def reference_parse(data: bytes, at: int, avail: int) -> tuple[bytes, list[bytes]] | None:
    """The record at `at` (bytes of the area seen twice, so no wrap) per the documented layout,
    or None when any check fails."""
    if avail > CAP:
        return None
    size, header_len, nbufs, magic = struct.unpack_from("<QQII", data, at)
    if magic != MAGIC or size < 64 or size % 64 or size > avail:
        return None
    fixed = 24 + 8 * nbufs
    if fixed > size or header_len > size - fixed:
        return None
    lens = struct.unpack_from(f"<{nbufs}Q", data, at + 24)
    off = up(fixed + header_len)
    buffers = []
    for n in lens:
        if off + n > size:
            return None
        buffers.append(data[at + off : at + off + n])
        off += up(n)
    if off != size:
        return None
    return data[at + fixed : at + fixed + header_len], buffers


def u64s(small: int) -> st.SearchStrategy[int]:
    """Mostly plausible values, some at the edges where sums wrap."""
    return st.one_of(
        st.integers(0, small),
        st.integers(0, U64),
        st.integers(0, 64).map(lambda k: U64 - k),
        st.integers(0, 64).map(lambda k: (1 << 63) + k),
    )


@st.composite
def garbage(draw: st.DrawFn) -> tuple[int, int, bytes]:
    """(start position, head, data area): a framed record with hostile fields, or raw bytes."""
    start = draw(st.one_of(st.integers(0, 4 * CAP), st.integers(0, U64)))
    start -= start % 64  # the consumer's tail is always a record boundary
    # seeded noise (small to draw), then drawn bytes over the record's first part
    area = bytearray(random.Random(draw(st.integers(0, 1 << 32))).randbytes(CAP))
    noise = draw(st.binary(max_size=256))
    for i, b in enumerate(noise):
        area[(start + i) % CAP] = b
    mode = draw(st.sampled_from(["plausible", "hostile", "raw"]))
    avail = draw(st.one_of(st.integers(0, CAP).map(lambda k: k - k % 64), u64s(CAP)))
    if mode != "raw":
        plausible = mode == "plausible"
        small = st.integers(0, 300)
        nbufs = draw(
            st.integers(0, 12)
            if plausible
            else st.one_of(st.integers(0, 12), st.integers(0, (1 << 32) - 1))
        )
        shown = min(nbufs, 12)
        lens = [draw(small if plausible else u64s(CAP)) for _ in range(shown)]
        header_len = draw(small if plausible else u64s(CAP))
        if plausible or draw(st.booleans()):  # the size the fields drawn add up to
            size = up(24 + 8 * nbufs + header_len) + sum(up(n) for n in lens)
            size &= U64
        else:
            size = draw(st.one_of(st.integers(0, CAP // 64).map(lambda k: 64 * k), u64s(CAP)))
        if plausible and size <= CAP:  # published: the record and maybe more
            avail = size + draw(st.integers(0, (CAP - size) // 64)) * 64
        magic = MAGIC if plausible or draw(st.integers(0, 9)) else draw(st.integers(0, U64 >> 32))
        framing = struct.pack("<QQII", size, header_len, nbufs & 0xFFFFFFFF, magic)
        framing += struct.pack(f"<{shown}Q", *lens)
        at = start % CAP
        for i, b in enumerate(framing):
            area[(at + i) % CAP] = b
    return start, (start + avail) & U64, bytes(area)


@pytest.fixture
def scribble(ring_name: Callable[[], str]):
    """A consumer handle on a fresh ring whose shared memory the test wrote first."""
    made: list[Ring] = []

    def make(start: int, head: int, area: bytes) -> Ring:
        ring = Ring.create(ring_name(), CAP)
        made.append(ring)
        with open(Path("/dev/shm", ring.name), "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            m[DATA : DATA + CAP] = area
            struct.pack_into("<Q", m, CONSUMER_POS, start)
            struct.pack_into("<Q", m, PRODUCER_POS, head)
        ring.claim("consumer")  # takes its read position from the tail written above
        return ring

    yield make
    for ring in made:
        ring.close()


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=garbage())
def test_pop_refuses_every_garbage_record(scribble, case):
    start, head, area = case
    ring = scribble(start, head, area)
    avail = (head - start) & U64
    expected = reference_parse(area + area, start % CAP, avail) if avail else None
    event("empty" if not avail else "garbage" if expected is None else "valid")
    if avail == 0:
        assert ring.try_pop() is None
    elif expected is None:
        with pytest.raises(RingCorrupt, match="corrupt"):
            ring.try_pop()
        with pytest.raises(RingCorrupt):  # refused again, not skipped
            ring.pop(timeout=0)
    else:
        rec = ring.try_pop()
        assert rec is not None
        header, buffers = expected
        assert bytes(rec.header) == header
        assert [bytes(b) for b in rec.buffers] == buffers
        rec.release()
    ring.close()


def test_producer_refuses_a_corrupt_tail(ring_name):
    producer = Ring.create(ring_name(), CAP, role="producer")
    try:
        producer.push(b"x" * (CAP // 2))  # the next push needs room: it reads the tail
        with open(Path("/dev/shm", producer.name), "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            struct.pack_into("<Q", m, CONSUMER_POS, 1 << 40)  # a tail far ahead of the head
        with pytest.raises(RingCorrupt, match="tail"):
            producer.push(b"x" * (CAP // 2), timeout=0)
    finally:
        producer.close()


def test_release_refuses_an_end_that_was_not_popped(ring_name):
    producer = Ring.create(ring_name(), CAP, role="producer")
    consumer = Ring.attach(producer.name, role="consumer")
    try:
        from omni_transport.cabi import lib, record_end, ring_handle

        producer.push(b"one")
        rec = consumer.pop(timeout=5)
        handle, end = ring_handle(consumer), record_end(rec)
        for wrong in (0, end + 64, end - 1):
            assert lib.omni_ring_release(handle, wrong) == lib.OMNI_EINVAL
        rec.release()
        assert lib.omni_ring_release(handle, end) == lib.OMNI_EINVAL  # not twice
    finally:
        consumer.close()
        producer.close()


@pytest.mark.parametrize(
    "meta",
    [b"not json", b"{}", b'[["O", [1]]]', b'[["<f4", [3]]]', b'[["<f4"]]', b'[["nope", [1]]]'],
)
def test_record_arrays_refuses_a_bad_descriptor(ring_name, meta):
    from omni_transport import record_arrays

    producer = Ring.create(ring_name(), CAP, role="producer")
    consumer = Ring.attach(producer.name, role="consumer")
    try:
        producer.push(b"", [meta, bytes(8)])  # one 8-byte array buffer
        with consumer.pop(timeout=5) as rec, pytest.raises(ValueError, match="not an array"):
            record_arrays(rec)
    finally:
        consumer.close()
        producer.close()
