"""The stop of `omni-server ray`: every pipeline replica drains as `omni-server` does on SIGTERM,
and only then does Serve delete them.

Serve's own stop is not enough on its own. `serve.delete` takes the application's route away
first, so the proxy answers new requests 404 in its own words; and a replica's graceful stop
waits for its ongoing requests with no bound of ours, until Serve's `graceful_shutdown_timeout_s`
kills it, and then its `__del__` never reaps the pipeline. So the command first releases a
`StopSignal` every replica waits on (`wait_for_stop`): each replica's own server answers new
requests 503 (OpenAI's error JSON, Retry-After) and gives its requests in flight
`--shutdown-grace` seconds, then reports back; once all have (or the bound has passed), Serve
deletes replicas that hold no request, and their `__del__` stops each pipeline (processes,
segments, run directory).

A replica waits in calls of `WAIT_S` each, and each call renews its lease: one that Serve
replaced long ago (a lost node, a failed health check) stopped renewing, and the stop does not
wait for it. The signal (`StopSignal`: the plain `StopBoard` as a Ray actor) is an actor of the
command's own job: it dies with the command, and a replica whose wait ends that way keeps
serving (Serve's own stop still reaps it).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import ray
from ray.actor import ActorHandle

WAIT_S = 30.0  # one wait call of a replica; its lease lasts that long plus LEASE_SLACK_S
LEASE_SLACK_S = 10.0  # a loaded machine's delay between two calls


class StopBoard:
    """Held by the command; every replica of its application waits on it from its start. Runs
    on one event loop (the actor's).

    Invariant: `_leases` maps each replica seen waiting to the loop time its lease ends;
    `_draining` (set by `stop()`) holds the replicas still to report drained."""

    def __init__(self, wait_s: float = WAIT_S, lease_slack_s: float = LEASE_SLACK_S) -> None:
        self.wait_s = wait_s
        self.lease_s = wait_s + lease_slack_s
        self._stop = asyncio.Event()
        self._reported = asyncio.Event()
        self._leases: dict[str, float] = {}
        self._draining: set[str] = set()

    async def wait(self, replica: str) -> bool:
        """True once the command stops; False after `wait_s` (the replica calls again)."""
        loop = asyncio.get_running_loop()
        self._leases[replica] = loop.time() + self.lease_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), self.wait_s)
        if self._stop.is_set():
            self._draining.add(replica)  # a replica first seen after the stop drains too
            return True
        return False

    def drained(self, replica: str) -> None:
        """The replica has no request in flight left and answers new ones 503."""
        self._draining.discard(replica)
        self._leases.pop(replica, None)
        self._reported.set()

    async def stop(self, timeout_s: float) -> list[str]:
        """Release every waiting replica and wait, at most `timeout_s`, until each replica with
        a live lease reports drained; returns those that did not."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._draining |= {r for r, until in self._leases.items() if until > now}
        self._stop.set()
        deadline = now + timeout_s
        while self._draining and loop.time() < deadline:
            self._reported.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reported.wait(), deadline - loop.time())
        return sorted(self._draining)


# the command's: StopSignal.remote() -> its ActorHandle (Ray's stubs type the wrapped class oddly)
StopSignal: Any = ray.remote(num_cpus=0)(StopBoard)


async def wait_for_stop(stop_signal: ActorHandle, replica: str) -> bool:
    """In a replica: True once the command stops (drain, then `report_drained`); False when the
    command is gone without stopping it (the replica serves on)."""
    try:
        while not await stop_signal.wait.remote(replica):
            pass
    except ray.exceptions.RayActorError:
        return False
    return True


async def report_drained(stop_signal: ActorHandle, replica: str) -> None:
    with contextlib.suppress(ray.exceptions.RayActorError):  # the command may be gone
        await stop_signal.drained.remote(replica)
