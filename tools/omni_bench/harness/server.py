"""An HTTP server the benchmark runs as its own child process: started on a free loopback port,
awaited until a readiness URL answers 200, stopped by SIGTERM (then SIGKILL after a grace).

Both servers the speech benchmark can start use it: `omni-server --repo DIR` (`--serve`) and
Piper's own Flask server (the `piper-http` peer).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import aiohttp

STOP_GRACE_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ChildServer:
    """`command(port)` is the argv; `ready_path` the URL path that answers 200 once it serves."""

    def __init__(
        self,
        name: str,
        command: Callable[[int], Sequence[str]],
        ready_path: str,
        *,
        ready_timeout_s: float = 180.0,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._command = list(command(self.port))
        self._ready_path = ready_path
        self._ready_timeout_s = ready_timeout_s
        self._cwd = cwd
        # The child's log; it must outlive start(), so no `with`: stop() closes it.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def log_tail(self, nbytes: int = 2000) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-nbytes:]

    async def start(self) -> None:
        """Start the child and wait until it is ready; on failure it is stopped and the error
        carries the tail of its log."""
        self._proc = subprocess.Popen(
            self._command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self._cwd,
        )
        deadline = time.monotonic() + self._ready_timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while True:
                if self._proc.poll() is not None:
                    code = self._proc.returncode
                    await self.stop()
                    raise RuntimeError(f"{self.name} exited with {code}:\n{self.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(self.url + self._ready_path) as response:
                        if response.status == 200:
                            return
                if time.monotonic() > deadline:
                    tail = self.log_tail()
                    await self.stop()
                    raise RuntimeError(
                        f"{self.name} not ready in {self._ready_timeout_s:.0f} s:\n{tail}"
                    )
                await asyncio.sleep(0.2)  # polling a child we cannot be told about otherwise

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)
        if not self._log.closed:
            self._log.close()
