"""The ring's waits on a contended core: no record lost or reordered, whichever way the spin
decides to wait (docs/transport.md, "Waking up": the contention check).

A process that spins (a hog, as a stage computing) is pinned to the CPU of the echo end
(contention_peer.py), so that end's spins lose their core to it; the test pings records at it
and pushes bursts that fill the ring (so the producer's wait for room runs too), and checks that
every record and every acknowledgement arrives, in order, with its bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_transport import Ring
from tests.transport.contention_peer import SEQ, payload

pytestmark = pytest.mark.timeout(120)

PEER = Path(__file__).with_name("contention_peer.py")

PAGE = os.sysconf("SC_PAGESIZE")
COUNT = 1000
BURST = 40  # records pushed before their acks are read: more than one page of ring holds


@pytest.fixture
def hog() -> Iterator[int]:
    """A process spinning on one CPU (the last this process may use); yields that CPU."""
    cpu = max(os.sched_getaffinity(0))
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    )
    try:
        yield cpu
    finally:
        proc.kill()
        proc.wait()


def ping(ring_name, cpu: int, *peer_args: str) -> tuple[dict, list[int]]:
    """Runs the echo end pinned to `cpu`: COUNT records one at a time, with a burst of BURST every
    250; returns the echo end's summary and the acknowledged sequence numbers, in order."""
    data = Ring.create(ring_name(), PAGE, role="producer")  # one page: a burst fills it
    ack = Ring.create(ring_name(), PAGE, role="consumer")
    args = [data.name, ack.name, "--count", str(COUNT), "--cpu", str(cpu), *peer_args]
    proc = subprocess.Popen(
        [sys.executable, str(PEER), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    acked: list[int] = []
    try:

        def take_ack() -> None:
            with ack.pop(timeout=60) as rec:
                acked.append(SEQ.unpack(rec.header)[0])

        seq = 0
        while seq < COUNT:
            n = min(BURST if seq % 250 == 0 else 1, COUNT - seq)
            for s in range(seq, seq + n):
                data.push(SEQ.pack(s), [payload(s)], timeout=60)
            for _ in range(n):
                take_ack()
            seq += n
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        data.close()
        ack.close()
    assert proc.returncode == 0, (out, err)
    return json.loads(out.strip().splitlines()[-1]), acked


def test_every_record_arrives_in_order_while_a_hog_shares_the_consumer_core(ring_name, hog):
    """The blocking pop whose core a hog shares: its spins lose that core, and it goes on to
    sleep at once (slept_at_once): every record and acknowledgement arrives, in order, intact."""
    summary, acked = ping(ring_name, hog)
    assert summary["received"] == COUNT
    assert acked == list(range(COUNT))
    counts = summary["wait_counts"]
    assert counts["spun"] + counts["slept"] > 0
    assert counts["slept_at_once"] > 0  # the check found the core contended


def test_pop_async_gets_every_record_in_order_while_a_hog_shares_its_core(ring_name, hog):
    """pop_async and push_async on the hog's core (the poll's contention check): every record
    and acknowledgement arrives, in order, intact."""
    summary, acked = ping(ring_name, hog, "--mode", "pop_async")
    assert summary["received"] == COUNT
    assert acked == list(range(COUNT))


def test_without_the_check_the_spin_never_sleeps_early(ring_name):
    """contention_check = False spins as before 2026-12-03: no wait hands over on a shared core
    or sleeps at once, whatever the machine's load; records still all arrive in order."""
    summary, acked = ping(ring_name, max(os.sched_getaffinity(0)), "--no-check")
    assert acked == list(range(COUNT))
    counts = summary["wait_counts"]
    assert counts["handed_over"] == counts["slept_at_once"] == 0
    assert counts["spun"] + counts["slept"] > 0


def test_the_check_is_on_by_default_and_the_environment_turns_it_off(ring_name, monkeypatch):
    monkeypatch.delenv("OMNI_RING_SPIN_CONTENTION", raising=False)
    with Ring.create(ring_name(), PAGE, role="consumer") as ring:
        assert ring.contention_check is True
        assert ring.wait_counts == dict.fromkeys(
            ("spun", "handed_over", "slept", "slept_at_once"), 0
        )
        ring.contention_check = False
        assert ring.contention_check is False
    monkeypatch.setenv("OMNI_RING_SPIN_CONTENTION", "0")
    with Ring.create(ring_name(), PAGE, role="consumer") as ring:
        assert ring.contention_check is False
