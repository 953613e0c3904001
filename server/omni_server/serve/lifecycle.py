"""The app's API requests in flight, and the stop that lets them finish first.

`serve()` (server.py) stops in this order: stop accepting connections, `begin_stop()` (new
requests on open connections get 503 `not_ready`), `drain(grace)`: wait up to the grace period
for the requests in flight, then cancel the rest. A request cancelled here knows why
(`stopping`), so it is logged and counted as `server_shutdown`, not as a client that left.
Health probes stay open while stopping: a load balancer must see `/health/ready` turn 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web

from omni_server.serve.errors import Handler, error_response

log = logging.getLogger(__name__)

UNTRACKED = frozenset({"/health", "/health/live", "/health/ready", "/metrics"})
# After cancelling, each handler aborts its request in every stage; this bounds that wait.
CANCEL_WAIT_S = 2.0


class Lifecycle:
    def __init__(self) -> None:
        self.stopping = False
        self._requests: set[asyncio.Task[object]] = set()

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    def begin_stop(self) -> None:
        self.stopping = True

    async def drain(self, grace_s: float) -> int:
        """Wait up to `grace_s` for the requests in flight; cancel those left. Returns how many
        were cancelled."""
        self.begin_stop()
        pending = set(self._requests)
        if pending:
            log.info("waiting up to %g s for %d request(s) in flight", grace_s, len(pending))
            _, pending = await asyncio.wait(pending, timeout=grace_s)
        if not pending:
            return 0
        log.info("cancelling %d request(s) still running after %g s", len(pending), grace_s)
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=CANCEL_WAIT_S)
        return len(pending)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in UNTRACKED:
            return await handler(request)
        if self.stopping:
            return error_response(503, "the server is shutting down", code="not_ready")
        task = asyncio.current_task()
        assert task is not None  # aiohttp runs each request in a task of its own
        self._requests.add(task)
        try:
            return await handler(request)
        finally:
            with contextlib.suppress(KeyError):
                self._requests.remove(task)
