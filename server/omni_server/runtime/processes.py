"""The stage processes of one plan: spawn, wait for ready, watch, stop, clean up.

One OS process per plan instance (replica, TP rank), each `python -m omni_server.runtime.worker`
in a private run directory that holds the ZMQ sockets and the pickled plan. Every child dies with
this process (PR_SET_PDEATHSIG). A child's exit is seen at once through its pidfd on the event
loop; an exit we did not ask for is reported to `on_death` (the runtime fails the requests that
may have reached it). stop() asks politely (Shutdown), then SIGTERM, then SIGKILL, reaps every
child, closes the rings and removes leftover segments and the run directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omni_server.repository.plan import Plan
from omni_transport import unlink_leftovers

from .channels import COORDINATOR, Endpoint
from .errors import PipelineError
from .links import ChannelLinks
from .messages import CoordinatorMessage, Ready, Shutdown, StartFailed
from .topology import Topology

log = logging.getLogger(__name__)

_STOP_GRACE_S = 5.0  # Shutdown -> SIGTERM
_TERM_GRACE_S = 2.0  # SIGTERM -> SIGKILL


class ProcessGroup:
    def __init__(
        self,
        plan: Plan,
        *,
        on_message: Callable[[CoordinatorMessage], None],
        on_death: Callable[[int, int | None], None],
        on_broken: Callable[[str], None],
        run_dir: Path | None = None,
        ring_capacity: int = 8 << 20,
    ) -> None:
        self.plan = plan
        self.topology = Topology(plan)
        self._on_message = on_message
        self._on_death = on_death
        self._on_broken_cb = on_broken
        self._own_run_dir = run_dir is None
        self.run_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)) if run_dir is None else run_dir
        if self._own_run_dir:  # who owns it: a later start removes it if we die unannounced
            (self.run_dir / OWNER_FILE).write_text(_process_identity(os.getpid()))
        self.run_id = secrets.token_hex(4)
        self._ring_capacity = ring_capacity
        self._procs: list[subprocess.Popen[bytes] | None] = []
        self._exited: list[asyncio.Future[int | None]] = []
        self._pidfds: list[int] = []
        self._ready: dict[str, asyncio.Future[None]] = {}
        self._endpoint: Endpoint | None = None
        self._stopping = False

    def pids(self) -> dict[str, int]:
        return {
            self.plan.instances[i].name: p.pid
            for i, p in enumerate(self._procs)
            if p is not None and p.returncode is None
        }

    # ---- start -------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _remove_dead_runs()
        _remove_dead_run_dirs()
        with open(self.run_dir / "plan.pkl", "wb") as f:
            pickle.dump(self.plan, f)
        self._endpoint = Endpoint(self.run_dir, self.run_id, COORDINATOR, self._ring_capacity)
        leaders = [i for i, inst in enumerate(self.plan.instances) if inst.tp_rank == 0]
        self._endpoint.create_inbound([str(i) for i in leaders])
        self._endpoint.start_receiving(self._receive, self._on_broken)
        ports = self._tp_ports()
        for index, instance in enumerate(self.plan.instances):
            self._ready[instance.name] = loop.create_future()
            self._spawn(index, ports.get((instance.process, instance.replica)))
        # wait for every Ready; the first StartFailed or death ends the wait
        pending: list[asyncio.Future[Any]] = [*self._ready.values()]
        while pending:
            done, _ = await asyncio.wait(
                [*pending, *self._exited], return_when=asyncio.FIRST_COMPLETED
            )
            for fut in done:
                if fut in self._exited:
                    index = self._exited.index(fut)
                    name = self.plan.instances[index].name
                    ready = self._ready[name]
                    if ready.done() and ready.exception() is not None:
                        ready.result()  # its StartFailed says more than its exit code
                    raise PipelineError(
                        f"process {name} exited with code {fut.result()} while starting",
                        code="unavailable",
                    )
                fut.result()  # raises the StartFailed message
            pending = [f for f in pending if not f.done()]

    def _on_broken(self, error: BaseException) -> None:
        self._on_broken_cb(f"the coordinator's receiver failed: {type(error).__name__}: {error}")

    def _tp_ports(self) -> dict[tuple[str, int], int]:
        """One free rendezvous port per TP group (process, replica)."""
        ports = {}
        for inst in self.plan.instances:
            if inst.tp_size > 1 and inst.tp_rank == 0:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    ports[(inst.process, inst.replica)] = s.getsockname()[1]
        return ports

    def _spawn(self, index: int, port: int | None) -> None:
        args = [sys.executable, "-m", "omni_server.runtime.worker"]
        args += [str(self.run_dir), self.run_id, str(index), str(os.getpid()), str(port or "")]
        env = {**os.environ, "OMNI_RING_CAPACITY": str(self._ring_capacity)}
        # stage processes log at the server's level unless told otherwise
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        env.setdefault("OMNI_LOG_LEVEL", level)
        proc = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL)
        self._procs.append(proc)
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[int | None] = loop.create_future()
        self._exited.append(exited)
        pidfd = os.pidfd_open(proc.pid)
        self._pidfds.append(pidfd)
        loop.add_reader(pidfd, self._reap, index)

    def _reap(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._pidfds[index])
        proc = self._procs[index]
        assert proc is not None
        code = proc.wait()
        exited = self._exited[index]
        if not exited.done():
            exited.set_result(code)
        name = self.plan.instances[index].name
        if not self._stopping:
            log.error(
                "stage process %s (pid %d) exited with code %s: pipeline unhealthy",
                name,
                proc.pid,
                code,
            )
            self._on_death(index, code)

    def _receive(self, message: Any) -> None:
        match message:
            case Ready():
                self._ready[message.instance].set_result(None)
            case StartFailed():
                fut = self._ready[message.instance]
                if not fut.done():
                    fut.set_exception(PipelineError(message.message, code="unavailable"))
                    fut.exception()  # seen: start() reports it
            case _:
                self._on_message(message)

    # ---- running -----------------------------------------------------------------------------

    @property
    def links(self) -> ChannelLinks:
        """The coordinator's links to the stage processes (valid once start() returned)."""
        assert self._endpoint is not None, "the process group is not started"
        return ChannelLinks(self._endpoint, alive=self._alive)

    def _alive(self, index: int) -> bool:
        return index < len(self._exited) and not self._exited[index].done()

    # ---- stop --------------------------------------------------------------------------------

    async def stop(self) -> None:
        self._stopping = True
        alive = [i for i, fut in enumerate(self._exited) if not fut.done()]
        if self._endpoint is not None:
            for index in alive:
                if self.plan.instances[index].tp_rank == 0:
                    self.links.control(index, Shutdown())
        await self._wait_exits(alive, _STOP_GRACE_S, signal.SIGTERM)
        await self._wait_exits(alive, _TERM_GRACE_S, signal.SIGKILL)
        await self._wait_exits(alive, _TERM_GRACE_S, None)
        loop = asyncio.get_running_loop()
        for index, pidfd in enumerate(self._pidfds):
            if not self._exited[index].done():
                loop.remove_reader(pidfd)
            os.close(pidfd)
        self._pidfds.clear()
        # Supervision never polls: exits arrive through pidfds. This blocking, bounded wait only
        # reaps a process whose pidfd has not fired even after SIGKILL (stuck in the kernel).
        for proc in self._procs:
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1.0)
        if self._endpoint is not None:
            await self._endpoint.close()
            self._endpoint = None
        unlink_leftovers(f"omni-{self.run_id}-")
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    async def _wait_exits(self, indexes: list[int], timeout: float, then: int | None) -> None:
        waiting = [self._exited[i] for i in indexes if not self._exited[i].done()]
        if not waiting:
            return
        await asyncio.wait(waiting, timeout=timeout)
        if then is None:
            return
        for index in indexes:
            proc = self._procs[index]
            if proc is not None and not self._exited[index].done():
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(then)


RUN_DIR_PREFIX = "omni-run-"
OWNER_FILE = "owner"


def _process_identity(pid: int) -> str:
    """pid and start time (clock ticks since boot, /proc/PID/stat field 22): a reused pid has
    another start time, so a dead owner is never mistaken for a live one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    start = stat.rsplit(")", 1)[1].split()[19]
    return f"{pid} {start}"


def _remove_dead_run_dirs() -> None:
    """Remove run directories (ZMQ sockets, the pickled plan) of our earlier servers that died
    without stopping (SIGKILL): those whose owner file names a process that no longer runs."""
    root = Path(tempfile.gettempdir())
    for run_dir in root.glob(RUN_DIR_PREFIX + "*"):
        try:
            if run_dir.stat().st_uid != os.getuid():
                continue
            owner = (run_dir / OWNER_FILE).read_text().strip()
        except OSError:
            continue  # no owner file yet: a server being born, or not ours to judge
        pid = owner.split()[0] if owner else ""
        if pid.isdigit() and _process_identity(int(pid)) != owner:
            shutil.rmtree(run_dir, ignore_errors=True)
            log.warning("removed the run directory %s of a dead server", run_dir)


_RUN_SEGMENT = re.compile(r"^omni-[0-9a-f]{8}-")


def _remove_dead_runs() -> None:
    """Remove the ring segments of earlier runs whose processes all died (a killed server)."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return
    runs = {m.group(0) for m in map(_RUN_SEGMENT.match, names) if m}
    removed = [name for run in sorted(runs) for name in unlink_leftovers(run)]
    if removed:
        log.warning("removed %d shared-memory segments of dead runs", len(removed))
