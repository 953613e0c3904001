"""What attach and the doorbell trust: a segment must be this user's, private, and its header must
match its file; a doorbell takes datagrams only from the peer it is connected to."""

from __future__ import annotations

import mmap
import os
import socket
import struct
from pathlib import Path

import pytest

from omni_transport import Ring, RingFull, SegmentRefused, unique_name

pytestmark = pytest.mark.timeout(60)

PAGE = os.sysconf("SC_PAGESIZE")
# documented layout (docs/transport.md)
FILE_SIZE, DATA_OFFSET, MIRROR_LEN = 16, 24, 32
CAPACITY = 256
SIDE = {"producer": 256 + 64, "consumer": 256 + 128}
BELL = 24  # u64 bell[2] in a side line


def poke(name: str, offset: int, value: int) -> None:
    with open(Path("/dev/shm", name), "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        struct.pack_into("<Q", m, offset, value)


def test_attach_refuses_a_segment_open_to_others(ring_name):
    ring = Ring.create(ring_name(), PAGE)
    try:
        os.chmod(Path("/dev/shm", ring.name), 0o666)
        with pytest.raises(SegmentRefused, match="mode 0666 gives others access"):
            Ring.attach(ring.name)
    finally:
        ring.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_attach_refuses_a_segment_of_another_user(ring_name):
    ring = Ring.create(ring_name(), PAGE)
    try:
        os.chown(Path("/dev/shm", ring.name), 65534, 65534)
        with pytest.raises(SegmentRefused, match="owned by uid 65534, not by this user"):
            Ring.attach(ring.name)
    finally:
        ring.close()


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [
        (FILE_SIZE, PAGE + 2 * PAGE, "corrupt"),  # bigger than the file: would map beyond it
        (DATA_OFFSET, 64, "corrupt"),
        (MIRROR_LEN, 2 * PAGE, "mirror of"),  # a mirror longer than the data area
        (MIRROR_LEN, 0, "mirror of"),
        (CAPACITY, 1 << 40, "capacity"),  # the ring control disagrees with the file
    ],
)
def test_attach_checks_every_header_field_against_the_file(ring_name, offset, value, message):
    ring = Ring.create(ring_name(), PAGE)
    try:
        poke(ring.name, offset, value)
        with pytest.raises(SegmentRefused, match=message):
            Ring.attach(ring.name)
    finally:
        ring.close()


def test_unique_names_are_unguessable():
    names = {unique_name("omni-x-") for _ in range(100)}
    assert len(names) == 100
    assert all(len(n) == len("omni-x-") + 32 for n in names)


def doorbell_address(ring_file: str, role: str) -> bytes:
    with open(Path("/dev/shm", ring_file), "rb") as f, mmap.mmap(f.fileno(), 0, access=1) as m:
        a, b = struct.unpack_from("<QQ", m, SIDE[role] + BELL)
    return b"\0" + f"omni-ring-{a:016x}{b:016x}".encode()


def test_no_other_process_can_ring_a_doorbell(ring_name):
    consumer = Ring.create(ring_name(), PAGE, role="consumer")
    intruder = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        # before the producer came a stranger's datagram is only a spurious wake-up: the
        # consumer's doorbell cannot be connected to a peer that does not exist yet
        producer = Ring.attach(consumer.name, role="producer")
        try:
            # the producer connected to the consumer's doorbell when it claimed; the consumer
            # connects back when it first looks at its peer (before any sleep)
            producer.push(b"x")
            with consumer.pop(timeout=5):
                pass
            assert consumer.try_pop() is None
            for role in ("consumer", "producer"):
                with pytest.raises(PermissionError):
                    intruder.sendto(b"w", doorbell_address(consumer.name, role))
        finally:
            producer.close()
    finally:
        intruder.close()
        consumer.close()


def test_doorbell_names_are_drawn_per_side(ring_name):
    # the old names were one nonce plus -p / -c: seeing the consumer's gave away the producer's
    consumer = Ring.create(ring_name(), PAGE, role="consumer")
    producer = Ring.attach(consumer.name, role="producer")
    try:
        c = doorbell_address(consumer.name, "consumer")
        p = doorbell_address(consumer.name, "producer")
        assert c[:-2] != p[:-2]  # not one name with a side suffix
    finally:
        producer.close()
        consumer.close()


@pytest.mark.parametrize("first", ["consumer", "producer"])
def test_the_doorbell_rings_whichever_side_claimed_first(ring_name, first):
    import select

    from omni_transport.cabi import lib, ring_handle

    second = "producer" if first == "consumer" else "consumer"
    a = Ring.create(ring_name(), PAGE, role=first)
    b = Ring.attach(a.name, role=second)
    producer, consumer = (a, b) if first == "producer" else (b, a)
    try:
        for _ in range(3):
            # the consumer declares itself asleep; the push must ring its doorbell (a wake-up
            # that never comes would leave the fd unreadable: waits then fall back to polls)
            assert lib.omni_ring_arm(ring_handle(consumer)) == lib.OMNI_OK
            producer.push(b"x")
            bell = lib.omni_ring_doorbell_fd(ring_handle(consumer))
            assert select.select([bell], [], [], 10)[0] == [bell]
            lib.omni_ring_disarm(ring_handle(consumer))
            consumer.pop(timeout=5).release()
        # and the other way: a producer waiting for room is rung by the release
        while True:
            try:
                producer.push(b"", [bytes(1000)], timeout=0)
            except RingFull:
                break
        assert lib.omni_ring_arm(ring_handle(producer)) == lib.OMNI_OK
        consumer.pop(timeout=5).release()
        bell = lib.omni_ring_doorbell_fd(ring_handle(producer))
        assert select.select([bell], [], [], 10)[0] == [bell]
        lib.omni_ring_disarm(ring_handle(producer))
    finally:
        b.close()
        a.close()
