"""The data plane under back-pressure: a full ring backlogs in order, drains on the receiver's
release (doorbell, no polling), spills what is too large, and drops once the receiver is gone.

Both endpoints live in this process on one event loop over real shared-memory rings and ZMQ
sockets: the sender's backlog can only drain while the receiver's loop task pops, which is what
makes the back-pressure observable without timing.
"""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest

from omni_server.wire.channels import Endpoint
from tests.helpers.proc import run_segments

pytestmark = pytest.mark.timeout(60)

_CAPACITY = 1 << 14  # 16 KiB: a few 1 KiB messages fill it; a 64 KiB one must spill


def _messages() -> list[dict]:
    out: list[dict] = [{"i": i, "data": np.full(256, i, dtype=np.float32)} for i in range(40)]
    out.insert(20, {"i": "big", "data": np.arange(1 << 14, dtype=np.float32)})  # 64 KiB
    return out


async def _pair(tmp_path) -> tuple[str, Endpoint, Endpoint]:
    run_id = uuid.uuid4().hex[:8]
    sender = Endpoint(tmp_path, run_id, "a", _CAPACITY)
    receiver = Endpoint(tmp_path, run_id, "b", _CAPACITY)
    receiver.create_inbound(["a"])
    return run_id, sender, receiver


async def test_a_full_ring_backlogs_in_order_and_drains_when_the_receiver_pops(tmp_path):
    run_id, sender, receiver = await _pair(tmp_path)
    got: list[dict] = []
    sent = _messages()
    all_in = asyncio.Event()

    def handle(message: dict) -> None:
        got.append(message)
        if len(got) == len(sent):
            all_in.set()

    try:
        for message in sent:
            sender.send_data("b", message)
        # nobody pops yet: the ring is full and the rest waits, however long flush waits
        await sender.flush(timeout=0.05)
        assert sender.backlog("b") > 0

        receiver.start_receiving(handle, lambda exc: pytest.fail(f"receiver broke: {exc}"))
        await asyncio.wait_for(all_in.wait(), 30)
        await sender.flush(timeout=30)
        assert sender.backlog("b") == 0
    finally:
        await sender.close()
        await receiver.close()
    assert [m["i"] for m in got] == [m["i"] for m in sent]
    for want, have in zip(sent, got, strict=True):
        assert np.array_equal(want["data"], have["data"])
    assert run_segments(run_id) == []


async def test_a_receiver_gone_drops_the_backlog_and_releases_flush(tmp_path):
    run_id, sender, receiver = await _pair(tmp_path)
    try:
        for message in _messages():
            sender.send_data("b", message)
        assert sender.backlog("b") > 0
        # the receiver closes its ring: the drain waiting on the doorbell sees RingClosed
        await receiver.close()
        await sender.flush(timeout=30)  # released by the drop, not by a pop
        assert sender.backlog("b") == 0
        sender.send_data("b", {"i": "after"})  # dropped, not queued, not raised
        assert sender.backlog("b") == 0
        await sender.flush(timeout=30)
    finally:
        await sender.close()
    assert run_segments(run_id) == []
