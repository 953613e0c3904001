"""A server the benchmark runs as its own child process: started on a free loopback port,
awaited until a readiness URL answers 200, stopped by SIGTERM (then SIGKILL after a grace).

`ChildServer` runs any HTTP server (Piper's Flask server for the `piper-http` peer);
`OmniServer` runs `python -m omni_server --repo DIR` and, once it stopped, checks what it left:
its stage processes (`python -m omni_server.stage.worker RUN_DIR RUN_ID INDEX ...`, children of
the server), its run directory and its ring segments (`/dev/shm/omni-RUN_ID-*`). Only this
server's own run is looked at, so other servers on the machine never count against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

STOP_GRACE_S = 30.0
WORKER = "omni_server.stage.worker"  # the stage process's module (its command line)
SHM = Path("/dev/shm")


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
        log: Path | None = None,
    ) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._command = list(command(self.port))
        self._ready_path = ready_path
        self._ready_timeout_s = ready_timeout_s
        self._cwd = cwd
        # The child's log (stdout and stderr): at `log`, kept after the run, or a nameless
        # temporary file. It must outlive start(), so no `with`: stop() closes it.
        self._log = tempfile.TemporaryFile() if log is None else log.open("w+b")  # noqa: SIM115
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def log_tail(self, nbytes: int = 2000) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-nbytes:]

    async def start(self) -> None:
        """Start the child and wait until it is ready; on failure it is stopped and the error
        (RuntimeError) carries the tail of its log."""
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
                    tail = self.log_tail()
                    await self.stop()
                    raise RuntimeError(f"{self.name} exited with {code}:\n{tail}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(self.url + self._ready_path) as response:
                        if response.status == 200:
                            self._ready()
                            return
                if time.monotonic() > deadline:
                    tail = self.log_tail()
                    await self.stop()
                    raise RuntimeError(
                        f"{self.name} not ready in {self._ready_timeout_s:.0f} s:\n{tail}"
                    )
                await asyncio.sleep(0.2)  # polling a child we cannot be told about otherwise

    def _ready(self) -> None:
        """Called once the child answered ready (a subclass notes what it runs)."""

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            self._stopping(proc.pid)
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)
        if not self._log.closed:
            self._log.close()

    def _stopping(self, pid: int) -> None:
        """Called just before the child is told to stop (a subclass notes what it runs)."""


@dataclass(frozen=True)
class StageProcess:
    """One of a server's stage processes, from its command line."""

    pid: int
    run_dir: Path
    run_id: str
    instance: int  # the plan instance it hosts (Plan.instances[instance])


def stage_processes(server_pid: int) -> list[StageProcess]:
    """The live stage processes of the omni-server with pid `server_pid`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue  # exited while we looked
        ppid = next((int(x.split()[1]) for x in status.splitlines() if x.startswith("PPid:")), 0)
        args = argv.split("\0")
        if ppid == server_pid and WORKER in args:
            run_dir, run_id, index = args[args.index(WORKER) + 1 : args.index(WORKER) + 4]
            found.append(StageProcess(int(entry), Path(run_dir), run_id, int(index)))
    return sorted(found, key=lambda p: p.instance)


def run_segments(run_id: str) -> list[str]:
    """The shared-memory segments (rings, CUDA pools, shared weights) of one server run."""
    return sorted(n for n in os.listdir(SHM) if n.startswith(f"omni-{run_id}-"))


def _is_stage_process(pid: int) -> bool:
    try:
        return WORKER in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


@dataclass
class Leftovers:
    """What a stopped server left of its run: all empty when it cleaned up."""

    processes: list[int] = field(default_factory=list)  # stage processes still running
    run_dirs: list[Path] = field(default_factory=list)
    segments: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.processes or self.run_dirs or self.segments)

    def __str__(self) -> str:
        if self.clean:
            return "nothing left"
        return (
            f"left {len(self.processes)} stage process(es) {self.processes}, "
            f"{len(self.run_dirs)} run directory(ies), {len(self.segments)} segment(s)"
        )


class ServerLeftovers(RuntimeError):
    """The server under test stopped but left part of its run behind."""


class OmniServer(ChildServer):
    """`python -m omni_server --repo REPO --port PORT [args]`, ready on /health/ready; its log
    kept at `log` when given."""

    def __init__(
        self,
        repo: Path,
        args: Sequence[str] = (),
        *,
        ready_timeout_s: float = 180.0,
        log: Path | None = None,
    ):
        command = [sys.executable, "-m", "omni_server", "--repo", str(repo)]
        super().__init__(
            "omni-server",
            lambda port: [*command, "--port", str(port), *args],
            "/health/ready",
            ready_timeout_s=ready_timeout_s,
            log=log,
        )
        self.stages: dict[int, StageProcess] = {}  # pid -> every stage process seen
        self.left = Leftovers()

    def _ready(self) -> None:
        self.see_stage_processes()

    def _stopping(self, pid: int) -> None:
        self.see_stage_processes()

    def see_stage_processes(self) -> list[StageProcess]:
        """The stage processes running now (restarted ones too), remembered for the check."""
        now = stage_processes(self.pid) if self.pid is not None else []
        self.stages.update((p.pid, p) for p in now)
        return now

    async def stop(self, *, check: bool = False) -> None:
        """Stop the server; then `self.left` says what of its run it left. With `check`,
        anything left raises ServerLeftovers."""
        await super().stop()
        runs = {(p.run_dir, p.run_id) for p in self.stages.values()}
        # a stage process dies with the server (PR_SET_PDEATHSIG): give the kernel a moment
        deadline = time.monotonic() + 5.0
        while any(map(_is_stage_process, self.stages)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.left = Leftovers(
            processes=sorted(pid for pid in self.stages if _is_stage_process(pid)),
            run_dirs=sorted(d for d, _ in runs if d.exists()),
            segments=[s for _, run_id in sorted(runs) for s in run_segments(run_id)],
        )
        if check and not self.left.clean:
            raise ServerLeftovers(f"{self.name} stopped but {self.left}")
