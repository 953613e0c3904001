"""One pipeline and the server's own aiohttp app, listening on a private Unix socket.

This is what a Serve replica runs: the same `Runtime` (stage processes spawned and supervised
as by `omni-server`) and the same `create_app` (every route, the door, the bounds, the error
JSON) as the single-host server; only the listening socket differs. The socket lives in a
directory of its own (mode 0700, created by mkdtemp), named and claimed like a run directory,
so a replica killed with its node leaves nothing a later start on that node does not remove,
and no other local user can connect to it. Two replicas on one node get two directories, two
runtimes with their own run directories and segment names: nothing of theirs collides.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from aiohttp import web

from omni_server.compiler.plan import Plan
from omni_server.pipeline import Runtime, run_dirs
from omni_server.serve import create_app
from omni_server.serve.options import ServeOptions
from omni_server.serve.state import STATE
from omni_server.serve.timeouts import make_runner

log = logging.getLogger(__name__)

SOCKET_NAME = "http.sock"


class PrivateServer:
    """start() -> serving on `socket_path`; stop() drains, stops the pipeline, removes the
    directory. Runs on the caller's event loop (the replica's), which must outlive it: the
    stage processes die with the thread that spawned them (PR_SET_PDEATHSIG)."""

    def __init__(self, plan: Plan, options: ServeOptions) -> None:
        self.plan = plan
        self.options = options
        self.runtime = Runtime(
            plan, supervision=options.supervision(), start_timeout=options.start_timeout_s
        )
        self.directory = Path(tempfile.mkdtemp(prefix=run_dirs.RUN_DIR_PREFIX))
        run_dirs.claim(self.directory)  # reaped by the next start here if we die unannounced
        self.socket_path = self.directory / SOCKET_NAME
        self._app = create_app(self.runtime, options=options)
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Listen, then start the pipeline; on any failure everything started is stopped and
        the error raised (Serve then reports the replica as failed to start)."""
        self._runner = make_runner(self._app, self.options)
        await self._runner.setup()
        try:
            await web.UnixSite(self._runner, str(self.socket_path)).start()
            self.socket_path.chmod(0o600)
            await self.runtime.start()
        except BaseException:
            await self.stop()
            raise
        log.info(
            "pipeline replica ready on %s (models: %s)",
            self.socket_path,
            ", ".join(self.plan.models) or "none",
        )

    def unhealthy(self) -> str | None:
        """Why this replica cannot serve (the pipeline's own health), or None."""
        if not self.runtime.ready:
            return "the pipeline is not running"
        status, detail = self.runtime.health()
        return detail if status == "unavailable" else None

    async def drain(self) -> int:
        """The first half of a stop, with the socket still open: new requests get 503 (OpenAI's
        error JSON, Retry-After), those in flight get the grace period and the rest are
        cancelled. Returns how many were cancelled. Serve's proxy may route here until the
        replica is deleted, and the 503 is then this server's answer, not a refused connection.
        """
        return await self._app[STATE].lifecycle.drain(self.options.shutdown_grace_s)

    async def stop(self) -> None:
        """As `omni-server` on SIGTERM: no new connections, in-flight requests get the grace
        period (none left after `drain()`), then the pipeline stops and its processes and
        segments are reaped."""
        try:
            if self._runner is not None:
                for site in list(self._runner.sites):
                    await site.stop()
                await self._app[STATE].lifecycle.drain(self.options.shutdown_grace_s)
                await self._runner.cleanup()
                self._runner = None
        finally:
            await self.runtime.stop()
            shutil.rmtree(self.directory, ignore_errors=True)
