"""Every death of a peer is seen: in its claim window (a test hook stops or kills it there), by
the non-blocking calls, through a process identity a reused pid cannot fake; and a segment whose
last user leaves while another attaches is not handed out half-gone."""

from __future__ import annotations

import mmap
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omni_transport import Ring, RingClosed, RingFull

pytestmark = pytest.mark.timeout(60)

PAGE = os.sysconf("SC_PAGESIZE")
SIDE = {"producer": 256 + 64, "consumer": 256 + 128}  # docs/transport.md
OWNER, STATE = 8, 16

ATTACHER = """
import sys
from omni_transport import Ring
try:
    ring = Ring.attach(sys.argv[1], role=sys.argv[2])
except Exception as e:
    print(type(e).__name__, e, flush=True)
    sys.exit(0)
print("ready", flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


def attacher(name: str, role: str, hook: str | None = None) -> subprocess.Popen[str]:
    env = dict(os.environ)
    if hook:
        env["OMNI_TRANSPORT_TEST_HOOK"] = hook
    return subprocess.Popen(
        [sys.executable, "-c", ATTACHER, name, role],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def wait_stopped(proc: subprocess.Popen[str]) -> None:
    """Until the process stopped itself (SIGSTOP at its hook)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        if fields[0] == "T":
            return
        time.sleep(0.01)
    raise AssertionError("the peer never reached its hook")


def finish(proc: subprocess.Popen[str]) -> str:
    """Its output once it exited (closing its stdin ends it; a stuck one is killed)."""
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=10)
    return out


def side_word(name: str, role: str, offset: int, fmt: str = "<Q") -> int:
    with open(Path("/dev/shm", name), "rb") as f, mmap.mmap(f.fileno(), 0, access=1) as m:
        return struct.unpack_from(fmt, m, SIDE[role] + offset)[0]


# ---- the claim window: between the side's owner CAS and ATTACHED ----


def test_a_claimer_alive_in_its_window_is_waited_for_and_its_death_seen(ring_name):
    consumer = Ring.create(ring_name(), PAGE, role="consumer")
    proc = attacher(consumer.name, "producer", hook="claim:stop")
    try:
        wait_stopped(proc)
        assert side_word(consumer.name, "producer", OWNER) & ((1 << 22) - 1) == proc.pid
        assert side_word(consumer.name, "producer", STATE, "<I") == 0  # not attached
        assert consumer.try_pop() is None  # a live claimer: still coming
        proc.kill()
        proc.wait(10)
        with pytest.raises(RingClosed, match="producer closed the ring or died"):
            consumer.try_pop()
        with pytest.raises(RingClosed):
            consumer.pop(timeout=None)  # no hang
    finally:
        finish(proc)
        consumer.close()


def test_a_blocked_pop_sees_a_death_in_the_claim_window(ring_name):
    consumer = Ring.create(ring_name(), PAGE, role="consumer")
    proc = attacher(consumer.name, "producer", hook="claim:kill")
    try:
        with pytest.raises(RingClosed):
            consumer.pop(timeout=None)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        finish(proc)
        consumer.close()


def test_a_side_whose_claimer_died_before_attaching_can_be_claimed_again(ring_name):
    consumer = Ring.create(ring_name(), PAGE, role="consumer")
    dead = attacher(consumer.name, "producer", hook="claim:kill")
    dead.wait(10)
    producer = Ring.attach(consumer.name, role="producer")
    try:
        producer.push(b"after")
        with consumer.pop(timeout=5) as rec:
            assert bytes(rec.header) == b"after"
    finally:
        finish(dead)
        producer.close()
        consumer.close()


# ---- non-blocking calls see a dead peer ----


def test_try_pop_sees_a_dead_producer(ring_name):
    consumer = Ring.create(ring_name(), PAGE, role="consumer")
    proc = attacher(consumer.name, "producer")
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert consumer.try_pop() is None
        proc.kill()
        proc.wait(10)
        with pytest.raises(RingClosed):
            consumer.try_pop()
    finally:
        finish(proc)
        consumer.close()


def test_push_without_waiting_sees_a_dead_consumer(ring_name):
    producer = Ring.create(ring_name(), PAGE, role="producer")
    proc = attacher(producer.name, "consumer")
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.kill()
        proc.wait(10)
        # room left is accepted without a system call per push; the first push that finds the
        # ring full looks at the consumer and says it died, never RingFull
        with pytest.raises(RingClosed, match="consumer closed the ring or died"):
            for _ in range(PAGE):
                producer.push(b"", [bytes(100)], timeout=0)
    finally:
        finish(proc)
        producer.close()


POPPER = """
import sys
from omni_transport import Ring
ring = Ring.attach(sys.argv[1], role="consumer", spin_us=0)
print("ready", flush=True)
ring.pop()  # blocks, asleep on its doorbell, until killed
"""


@pytest.mark.parametrize("seen_alive", [True, False])
def test_push_sees_a_consumer_that_died_asleep_at_once(ring_name, seen_alive):
    producer = Ring.create(ring_name(), PAGE, role="producer")
    proc = subprocess.Popen(
        [sys.executable, "-c", POPPER, producer.name], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 20  # until it declared itself asleep
        while not side_word(producer.name, "consumer", STATE + 4, "<I"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        if seen_alive:  # connected to its doorbell: the first push finds the socket gone
            assert not producer.peer_gone()
        proc.kill()
        proc.wait(10)
        # the first push rings a doorbell that is gone; the next one does not fill the ring
        # for no one
        producer.push(b"first", timeout=0)
        with pytest.raises(RingClosed, match="consumer closed the ring or died"):
            producer.push(b"second", timeout=0)
    finally:
        finish(proc)
        producer.close()


def test_push_without_waiting_is_full_while_the_consumer_lives(ring_name):
    producer = Ring.create(ring_name(), PAGE, role="producer")
    proc = attacher(producer.name, "consumer")
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        with pytest.raises(RingFull):
            for _ in range(PAGE):
                producer.push(b"", [bytes(100)], timeout=0)
    finally:
        finish(proc)
        producer.close()


# ---- identities, not bare pids ----


def test_a_reused_pid_does_not_make_a_dead_peer_look_alive(ring_name):
    consumer = Ring.create(ring_name(), PAGE, role="consumer")
    proc = attacher(consumer.name, "producer")
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.kill()
        proc.wait(10)
        # what pid reuse looks like: the recorded pid now names a live process (the bystander)
        # that started at another time than the one recorded (one tick earlier here: the two
        # children may well have started in the same tick)
        stat = Path(f"/proc/{bystander.pid}/stat").read_text().rsplit(")", 1)[1].split()
        started = int(stat[19])  # field 22
        reused = ((started - 1) << 22) | bystander.pid
        with open(Path("/dev/shm", consumer.name), "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            struct.pack_into("<Q", m, SIDE["producer"] + OWNER, reused)
        assert bystander.poll() is None
        with pytest.raises(RingClosed):
            consumer.try_pop()
    finally:
        bystander.kill()
        bystander.wait(10)
        finish(proc)
        consumer.close()


# ---- leaving while another attaches ----


def test_the_last_user_leaving_during_an_attach_fails_that_attach(ring_name, shm_prefix):
    ring = Ring.create(ring_name(), PAGE)
    name = ring.name
    proc = attacher(name, "producer", hook="attach:stop")
    try:
        wait_stopped(proc)  # between its shm_open and taking a user slot
        ring.close()  # the last recorded user: unlinks the name
        assert not Path("/dev/shm", name).exists()
        proc.send_signal(signal.SIGCONT)
        out = finish(proc)
        assert out.startswith("RingClosed") and "closed it while we attached" in out
    finally:
        finish(proc)
        ring.close()
    assert not list(Path("/dev/shm").glob(shm_prefix + "*"))


# ---- timeouts ----


def test_huge_and_bad_timeouts(ring_name):
    producer = Ring.create(ring_name(), PAGE, role="producer")
    consumer = Ring.attach(producer.name, role="consumer")
    try:
        producer.push(b"x", timeout=9.2e9)  # beyond int64 nanoseconds: forever, no overflow
        with consumer.pop(timeout=9.2e9) as rec:
            assert bytes(rec.header) == b"x"
        for bad in (-1.0, float("nan")):
            with pytest.raises(ValueError, match="timeout"):
                consumer.pop(timeout=bad)
        with pytest.raises(ValueError, match="spin_us"):
            consumer.spin_us = -1
    finally:
        consumer.close()
        producer.close()
