"""The stage processes of one plan: spawn, wait for ready, watch, stop, clean up.

One OS process per plan instance (replica, TP rank), each `python -m omni_server.stage.worker`
in a private run directory that holds the ZMQ sockets and the pickled plan. Every child dies with
this process (PR_SET_PDEATHSIG). A child's exit is seen at once through its pidfd on the event
loop; an exit we did not ask for is reported to `on_death` (the runtime fails the requests that
may have reached it). A child whose heartbeats stop (heartbeats.py) is killed, which is then such
an exit. stop() asks politely (Shutdown), then SIGTERM, then SIGKILL, reaps every child, closes
the rings and removes leftover segments and the run directory.

Restart (`restart(index)`): a successor takes a new endpoint name (`endpoint_name`: `3`, then
`3.1`, `3.2`...), so no ring, socket or spilled message of its dead predecessor can reach it
or be mistaken for its own. Before it is spawned every live peer drops the old name's rings and
sockets and creates the inbound ring from the new name (`Rewire` -> `Rewired`), the server does
the same, and the old name's segments are unlinked; the successor then creates its own inbound
rings under the new name and reports Ready like any process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
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

from omni_server.compiler.plan import Plan
from omni_server.errors import PipelineError
from omni_server.gpu import mps
from omni_server.gpu.devices import Machine
from omni_server.gpu.weights import followers_of, leaders_of, start_waves
from omni_server.wire.channels import COORDINATOR, Endpoint, ring_name
from omni_server.wire.heartbeats import HeartbeatMonitor
from omni_server.wire.links import ChannelLinks
from omni_server.wire.messages import (
    CoordinatorMessage,
    Ready,
    Rewire,
    Rewired,
    Shutdown,
    StartFailed,
)
from omni_server.wire.routes import Routes
from omni_transport import unlink_leftovers

from . import run_dirs

log = logging.getLogger(__name__)

_STOP_GRACE_S = 5.0  # Shutdown -> SIGTERM
_TERM_GRACE_S = 2.0  # SIGTERM -> SIGKILL
# a process that exited while starting: how long its StartFailed may take to arrive after its
# exit was seen (the worker spends at most its own _LAST_WORD_S delivering it)
_LAST_WORD_S = 2.0
_REWIRE_WAIT_S = 10.0  # a live peer that has not answered Rewire by then is not waited for


def endpoint_name(index: int, generation: int) -> str:
    """The endpoint (rings, socket) name of instance `index` in its `generation`-th life."""
    return str(index) if generation == 0 else f"{index}.{generation}"


class StageProcesses:
    def __init__(
        self,
        plan: Plan,
        *,
        on_message: Callable[[CoordinatorMessage], None],
        on_death: Callable[[int, int | None, str | None], None],
        on_broken: Callable[[str], None],
        run_dir: Path | None = None,
        ring_capacity: int = 8 << 20,
        heartbeat_interval_s: float = 1.0,
        heartbeat_timeout_s: float = 10.0,
        start_timeout_s: float = 300.0,
        machine: Machine | None = None,
    ) -> None:
        """`on_death(index, exit code, why we killed it or None)` for every exit we did not
        ask for with stop(). `machine`: the GPUs (None: the plan uses none), for MPS."""
        self.plan = plan
        self.routes = Routes(plan)
        self._on_message = on_message
        self._on_death = on_death
        self._on_broken_cb = on_broken
        self._own_run_dir = run_dir is None
        self.run_dir = (
            Path(tempfile.mkdtemp(prefix=run_dirs.RUN_DIR_PREFIX)) if run_dir is None else run_dir
        )
        if self._own_run_dir:  # who owns it: a later start removes it if we die unannounced
            run_dirs.claim(self.run_dir)
        self.run_id = secrets.token_hex(4)
        self._ring_capacity = ring_capacity
        self._heartbeat_interval_s = heartbeat_interval_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._start_timeout_s = start_timeout_s
        n = len(plan.instances)
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self._exited: list[asyncio.Future[int | None] | None] = [None] * n
        self._pidfds: list[int] = [-1] * n
        self._generation = [0] * n
        self._names = [endpoint_name(i, 0) for i in range(n)]
        self._killed_for: list[str | None] = [None] * n
        self._pid_index: dict[int, int] = {}
        self._ready: dict[str, asyncio.Future[None]] = {}
        # (peer, restarting instance) -> answered: a peer's Rewired, or its death
        self._acks: dict[tuple[int, int], asyncio.Future[None]] = {}
        self._spawning = asyncio.Lock()  # one rewire + spawn at a time (names change)
        # weight sharing (weights.py): a follower aliases its leaders' memory, so it starts
        # after them, dies with them, and stops before them
        self._followers = {i: followers_of(plan, i) for i in range(n)}
        self._leaders = {i: leaders_of(plan, i) for i in range(n)}
        self._up = [asyncio.Event() for _ in range(n)]  # set while ready and alive
        self._endpoint: Endpoint | None = None
        self._monitor: HeartbeatMonitor | None = None
        self._stopping = False
        self._machine = machine
        self._mps: mps.MpsDaemon | None = None
        self._mps_clients: dict[int, int] = {}  # instance index -> its GPU, under the daemon

    def pids(self) -> dict[str, int]:
        return {
            self.plan.instances[i].name: p.pid
            for i, p in enumerate(self._procs)
            if p is not None and p.returncode is None
        }

    def name(self, index: int) -> str:
        """Instance `index`'s endpoint name in its current life."""
        return self._names[index]

    # ---- start -------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        run_dirs.remove_dead_runs()
        if self._machine is not None:
            try:
                started = await asyncio.to_thread(mps.start, self.plan, self._machine, self.run_dir)
            except mps.MpsUnavailable as exc:
                raise PipelineError(str(exc), code="unavailable") from exc
            self._mps, self._mps_clients = started
        with open(self.run_dir / "plan.pkl", "wb") as f:
            pickle.dump(self.plan, f)
        self._endpoint = Endpoint(self.run_dir, self.run_id, COORDINATOR, self._ring_capacity)
        leaders = [i for i, inst in enumerate(self.plan.instances) if inst.tp_rank == 0]
        self._endpoint.create_inbound([self._names[i] for i in leaders])
        self._endpoint.start_receiving(self._receive, self._on_broken)
        if self._heartbeat_timeout_s > 0:
            self._monitor = HeartbeatMonitor(
                self.run_dir, self._heartbeat_timeout_s, self._heartbeat_missed
            )
            self._monitor.start()
        ports = self._tp_ports()
        # weight-sharing followers start once their leaders are ready (one wave without sharing)
        for wave in start_waves(self.plan):
            for index in wave:
                instance = self.plan.instances[index]
                self._ready[instance.name] = loop.create_future()
                self._spawn(index, ports.get((instance.process, instance.replica)))
            await self._wait_ready()

    async def _wait_ready(self) -> None:
        """Wait for every spawned instance's Ready; the first StartFailed or death ends it."""
        exited = [f for f in self._exited if f is not None]
        pending: list[asyncio.Future[Any]] = [*self._ready.values()]
        while pending:
            done, _ = await asyncio.wait([*pending, *exited], return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                if fut in exited:
                    index = self._exited.index(fut)
                    await self._raise_start_exit(index, fut.result())
                fut.result()  # raises the StartFailed message
            pending = [f for f in pending if not f.done()]

    async def _raise_start_exit(self, index: int, code: int | None) -> None:
        name = self.plan.instances[index].name
        ready = self._ready[name]
        # A worker sends StartFailed before it exits, but its exit (the pidfd) may reach the loop
        # before the receiver hands over that message (a loaded machine): wait for it a moment,
        # as it says more than the exit code (wait_for raises the StartFailed it carries).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(ready), _LAST_WORD_S)
        raise PipelineError(
            f"process {name} exited with code {code} while starting", code="unavailable"
        )

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
        args = [sys.executable, "-m", "omni_server.stage.worker"]
        args += [str(self.run_dir), self.run_id, str(index), str(os.getpid()), str(port or "")]
        args.append(",".join(self._names))
        env = {
            **os.environ,
            "OMNI_RING_CAPACITY": str(self._ring_capacity),
            "OMNI_HEARTBEAT_S": str(self._heartbeat_interval_s if self._monitor else 0),
        }
        # stage processes log at the server's level unless told otherwise
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        env.setdefault("OMNI_LOG_LEVEL", level)
        if self._mps is not None and index in self._mps_clients:
            env = self._mps.client_env(env)
        proc = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL)
        self._procs[index] = proc
        self._killed_for[index] = None
        loop = asyncio.get_running_loop()
        self._exited[index] = loop.create_future()
        pidfd = os.pidfd_open(proc.pid)
        self._pidfds[index] = pidfd
        loop.add_reader(pidfd, self._reap, index)
        self._pid_index[proc.pid] = index
        if self._monitor is not None:  # until its first beat it may be importing
            self._monitor.watch(proc.pid, self._start_timeout_s)

    def _reap(self, index: int) -> None:
        loop = asyncio.get_running_loop()
        pidfd, self._pidfds[index] = self._pidfds[index], -1
        loop.remove_reader(pidfd)
        os.close(pidfd)
        proc = self._procs[index]
        assert proc is not None
        code = proc.wait()
        self._pid_index.pop(proc.pid, None)
        if self._monitor is not None:
            self._monitor.forget(proc.pid)
        exited = self._exited[index]
        if exited is not None and not exited.done():
            exited.set_result(code)
        self._up[index].clear()
        for key in [k for k in self._acks if k[0] == index]:
            ack = self._acks.pop(key)
            if not ack.done():
                ack.set_result(None)  # a dead peer needs no rewiring
        name = self.plan.instances[index].name
        if not self._stopping:
            why = self._killed_for[index]
            # a process that dies while starting fails its start (or restart), whose error says
            # so, with the process's own last word when it sent one: one ERROR line, not two
            ready = self._ready.get(name)
            starting = (
                ready is None or not ready.done() or ready.cancelled() or bool(ready.exception())
            )
            (log.warning if starting else log.error)(
                "stage process %s (pid %d) exited with code %s%s",
                name,
                proc.pid,
                code,
                f" (killed: {why})" if why else "",
            )
            self._on_death(index, code, why)
            for follower in sorted(self._followers.get(index, ())):
                self.kill(follower, f"its weight-sharing leader {name} died")

    def _receive(self, message: Any) -> None:
        match message:
            case Ready():
                fut = self._ready[message.instance]
                if not fut.done():
                    fut.set_result(None)
                for i, inst in enumerate(self.plan.instances):
                    if inst.name == message.instance and self.alive(i):
                        self._up[i].set()
                self._arm_heartbeats(message.instance)
            case StartFailed():
                fut = self._ready[message.instance]
                if not fut.done():
                    fut.set_exception(PipelineError(message.message, code="unavailable"))
                    fut.exception()  # seen: start() reports it
            case Rewired():
                self._rewire_answered(message)
            case _:
                self._on_message(message)

    def _arm_heartbeats(self, instance: str) -> None:
        """`instance` is ready (every TP rank reports its own Ready): it must beat from now."""
        if self._monitor is None:
            return
        for index, inst in enumerate(self.plan.instances):
            proc = self._procs[index]
            if inst.name == instance and proc is not None:
                self._monitor.arm(proc.pid)

    def _rewire_answered(self, message: Rewired) -> None:
        for index, inst in enumerate(self.plan.instances):
            if inst.name == message.instance:
                ack = self._acks.pop((index, message.index), None)
                if ack is not None and not ack.done():
                    ack.set_result(None)
                return

    def _is_ready(self, index: int) -> bool:
        ready = self._ready.get(self.plan.instances[index].name)
        return ready is not None and ready.done() and ready.exception() is None

    # ---- supervision -------------------------------------------------------------------------

    def alive(self, index: int) -> bool:
        """Whether instance `index`'s current process runs (it may still be starting)."""
        exited = self._exited[index]
        return exited is not None and not exited.done()

    def kill(self, index: int, why: str) -> None:
        """SIGKILL instance `index` now (frozen, or a stuck compute thread); its exit is then
        reported to on_death with `why`."""
        proc = self._procs[index]
        if proc is None or not self.alive(index) or self._stopping:
            return
        if self._killed_for[index] is None:
            self._killed_for[index] = why
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)

    def _heartbeat_missed(self, pid: int) -> None:
        index = self._pid_index.get(pid)
        if index is None:
            return
        timeout = self._heartbeat_timeout_s
        self.kill(index, f"frozen: no heartbeat for {timeout:g} s")

    async def restart(self, index: int) -> None:
        """Start a successor of dead instance `index` under a new endpoint name; returns once
        it is ready. Raises PipelineError if it exits or fails while starting."""
        instance = self.plan.instances[index]
        assert instance.tp_size == 1, "a TP group is not restarted"
        assert not self.alive(index) and self._endpoint is not None
        await self._leaders_up(index)
        async with self._spawning:
            old = self._names[index]
            self._generation[index] += 1
            new = endpoint_name(index, self._generation[index])
            await self._rewire(index, old, new)
            self._names[index] = new
            self._ready[instance.name] = asyncio.get_running_loop().create_future()
            self._spawn(index, None)
        # not under the lock: a successor slow (or frozen) in starting holds up no other restart
        exited = self._exited[index]
        assert exited is not None
        ready = self._ready[instance.name]
        waits: list[asyncio.Future[Any]] = [ready, exited]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            await self._raise_start_exit(index, exited.result())
        ready.result()  # raises its StartFailed
        # peers restarted while this one started told it their new names before it could
        # listen: it is ready for requests once it has taken them in
        owed = [ack for (peer, _), ack in self._acks.items() if peer == index]
        if owed:
            await asyncio.wait(owed, timeout=_REWIRE_WAIT_S)

    async def _leaders_up(self, index: int) -> None:
        """Wait (bounded by the start timeout) until every weight-sharing leader of `index` is
        ready: a follower attaches to the memory of a live leader only."""
        for leader in sorted(self._leaders[index]):
            try:
                await asyncio.wait_for(self._up[leader].wait(), self._start_timeout_s)
            except TimeoutError:
                name = self.plan.instances[leader].name
                raise PipelineError(
                    f"{self.plan.instances[index].name} shares the weights of {name}, which "
                    f"is not back after {self._start_timeout_s:g} s",
                    code="unavailable",
                ) from None

    async def _rewire(self, index: int, old: str, new: str) -> None:
        """Every live peer (and this process) forgets `old` and is ready to receive from
        `new`; the segments of `old` are then unlinked (no live process maps them any more)."""
        assert self._endpoint is not None
        loop = asyncio.get_running_loop()
        peers = [
            i
            for i, inst in enumerate(self.plan.instances)
            if i != index and inst.tp_rank == 0 and self.alive(i)
        ]
        for peer in peers:
            self._acks[(peer, index)] = loop.create_future()
            self.links.control(peer, Rewire(index, old, new))
        await self._endpoint.forget_peer(old)
        self._endpoint.add_inbound(new)
        # a peer still starting reads control only once started: its successor-to-be waits
        # for its answer in restart(), not this rewire
        ready = [p for p in peers if self._is_ready(p)]
        acks = [a for p in ready if (a := self._acks.get((p, index))) is not None]
        if acks:
            _, late = await asyncio.wait(acks, timeout=_REWIRE_WAIT_S)
            if late:
                log.warning("%d peers did not confirm rewiring %s -> %s", len(late), old, new)
        for peer in ready:
            self._acks.pop((peer, index), None)
        for other in [COORDINATOR, *self._names]:
            if other != old:
                unlink_leftovers(ring_name(self.run_id, other, old))
                unlink_leftovers(ring_name(self.run_id, old, other))

    # ---- running -----------------------------------------------------------------------------

    @property
    def links(self) -> ChannelLinks:
        """The coordinator's links to the stage processes (valid once start() returned)."""
        assert self._endpoint is not None, "the process group is not started"
        return ChannelLinks(self._endpoint, alive=self.alive, name=self.name)

    # ---- stop --------------------------------------------------------------------------------

    async def stop(self) -> None:
        self._stopping = True
        # weight-sharing followers unmap their leaders' memory before the leaders free it:
        # the waves of start, in reverse (one wave without sharing)
        for wave in reversed(start_waves(self.plan)):
            await self._stop_instances([i for i in wave if self.alive(i)])
        loop = asyncio.get_running_loop()
        for index, pidfd in enumerate(self._pidfds):
            if pidfd >= 0:
                loop.remove_reader(pidfd)
                os.close(pidfd)
                self._pidfds[index] = -1
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        # Supervision never polls: exits arrive through pidfds. This blocking, bounded wait only
        # reaps a process whose pidfd has not fired even after SIGKILL (stuck in the kernel).
        for proc in self._procs:
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1.0)
        if self._endpoint is not None:
            await self._endpoint.close()
            self._endpoint = None
        if self._mps is not None:  # after its clients exited
            await asyncio.to_thread(self._mps.stop)
            self._mps = None
        unlink_leftovers(f"omni-{self.run_id}-")
        if self._own_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    async def _stop_instances(self, alive: list[int]) -> None:
        """Shutdown, then SIGTERM after the grace, then SIGKILL; returns once all exited."""
        if self._endpoint is not None:
            for index in alive:
                if self.plan.instances[index].tp_rank == 0:
                    self.links.control(index, Shutdown())
        await self._wait_exits(alive, _STOP_GRACE_S, signal.SIGTERM)
        await self._wait_exits(alive, _TERM_GRACE_S, signal.SIGKILL)
        await self._wait_exits(alive, _TERM_GRACE_S, None)

    async def _wait_exits(self, indexes: list[int], timeout: float, then: int | None) -> None:
        waiting = [f for i in indexes if (f := self._exited[i]) is not None and not f.done()]
        if not waiting:
            return
        await asyncio.wait(waiting, timeout=timeout)
        if then is None:
            return
        for index in indexes:
            proc = self._procs[index]
            if proc is not None and self.alive(index):
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(then)
