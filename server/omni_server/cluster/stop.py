"""The stop of `omni-server ray`: every pipeline replica drains as `omni-server` does on SIGTERM,
and only then does Serve delete them.

Serve's own stop is not enough on its own. `serve.delete` takes the application's route away
first, so the proxy answers new requests 404 in its own words; and a replica's graceful stop
waits for its ongoing requests with no bound of ours, until Serve's `graceful_shutdown_timeout_s`
kills it, and then its `__del__` never reaps the pipeline. So the command first releases a
`StopSignal` every replica waits on: each replica's own server answers new requests 503 (OpenAI's
error JSON, Retry-After) and gives its requests in flight `--shutdown-grace` seconds, then reports
back; once all have (or the bound has passed), Serve deletes replicas that hold no request, and
their `__del__` stops each pipeline (processes, segments, run directory).

The signal is an actor of the command's own job: it dies with the command, and a replica whose
wait ends that way keeps serving (Serve's own stop still reaps it).
"""

from __future__ import annotations

import asyncio
import contextlib

import ray


@ray.remote(num_cpus=0)
class StopSignal:
    """Held by the command; every replica of its application waits on it from its start.

    Invariant: `_draining` holds the replicas waiting or draining, not yet reported drained."""

    def __init__(self) -> None:
        self._stop = asyncio.Event()
        self._reported = asyncio.Event()
        self._draining: set[str] = set()

    async def wait(self, replica: str) -> None:
        """The replica's standing call: returns once the command stops."""
        self._draining.add(replica)
        await self._stop.wait()

    def drained(self, replica: str) -> None:
        """The replica has no request in flight left and answers new ones 503."""
        self._draining.discard(replica)
        self._reported.set()

    async def stop(self, timeout_s: float) -> list[str]:
        """Release every waiting replica and wait, at most `timeout_s`, until each reports
        drained; returns those that did not (a replica lost meanwhile never reports)."""
        self._stop.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._draining and loop.time() < deadline:
            self._reported.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reported.wait(), deadline - loop.time())
        return sorted(self._draining)
