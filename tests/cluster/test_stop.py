"""The stop protocol of `omni-server ray` (cluster/stop.py) on its own: `StopBoard`, the class
the command runs as its `StopSignal` actor, driven here on one event loop as the actor runs it
(no Ray instance: the board is plain asyncio). Replicas are coroutines calling it as the
replicas' `wait_for_stop` does; the test_ray_command_stop.py tests run it through Ray."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray")

from omni_server.cluster.stop import StopBoard

# A short lease, so that a replica that stopped renewing is seen gone within the test.
WAIT_S = 0.05
LEASE_SLACK_S = 0.05


async def _replica(board: StopBoard, name: str, drained: asyncio.Event) -> str:
    """A replica: waits in renewed calls until the stop, drains (until `drained`), reports."""
    while not await board.wait(name):
        pass
    await drained.wait()
    board.drained(name)
    return name


def test_stop_releases_every_waiting_replica_and_returns_once_all_have_drained() -> None:
    async def scenario() -> tuple[list[str], list[str], bool]:
        board = StopBoard(WAIT_S, LEASE_SLACK_S)
        drained = asyncio.Event()
        replicas = [asyncio.ensure_future(_replica(board, n, drained)) for n in ("a", "b")]
        await asyncio.sleep(WAIT_S * 3)  # several renewals: waiting is not stopping
        still_waiting = not any(r.done() for r in replicas)
        stopping = asyncio.ensure_future(board.stop(timeout_s=60))
        await asyncio.sleep(WAIT_S)
        assert not stopping.done(), "the stop returned before the replicas drained"
        drained.set()
        return await stopping, sorted(await asyncio.gather(*replicas)), still_waiting

    late, finished, still_waiting = asyncio.run(scenario())
    assert still_waiting
    assert finished == ["a", "b"]
    assert late == []


def test_a_replica_that_stopped_renewing_is_not_waited_for() -> None:
    """A replica Serve replaced long ago (its node lost): the stop does not wait out its bound."""

    async def scenario() -> list[str]:
        board = StopBoard(WAIT_S, LEASE_SLACK_S)
        assert await board.wait("gone") is False  # one call, then never again
        drained = asyncio.Event()
        drained.set()
        live = asyncio.ensure_future(_replica(board, "live", drained))
        await asyncio.sleep((WAIT_S + LEASE_SLACK_S) * 4)  # the gone one's lease is over
        late = await board.stop(timeout_s=60)
        await live
        return late

    assert asyncio.run(scenario()) == []


def test_a_replica_that_never_reports_is_named_late_at_the_bound() -> None:
    async def scenario() -> list[str]:
        board = StopBoard(WAIT_S, LEASE_SLACK_S)
        never = asyncio.Event()
        replica = asyncio.ensure_future(_replica(board, "stuck", never))
        await asyncio.sleep(WAIT_S)
        late = await board.stop(timeout_s=WAIT_S * 2)
        replica.cancel()
        return late

    assert asyncio.run(scenario()) == ["stuck"]


def test_a_replica_first_seen_after_the_stop_drains_too() -> None:
    """One that Serve was still starting when the command stopped: its first wait returns at
    once, and the stop waits for its report like the others'."""

    async def scenario() -> tuple[bool, list[str]]:
        board = StopBoard(WAIT_S, LEASE_SLACK_S)
        stopping = asyncio.ensure_future(board.stop(timeout_s=60))
        await asyncio.sleep(0)
        released = await board.wait("late-starter")
        board.drained("late-starter")
        return released, await stopping

    released, late = asyncio.run(scenario())
    assert released is True
    assert late == []
