"""A stage process:
`python -m omni_server.stage.worker RUN_DIR RUN_ID INDEX PARENT_PID [PORT] [NAMES]`.

Hosts the stages of plan instance INDEX (the plan is pickled in RUN_DIR/plan.pkl). It dies with
its parent (PR_SET_PDEATHSIG), beats its heartbeat from a thread of its own, reports Ready or
StartFailed to the coordinator, then serves until Shutdown (or SIGTERM). NAMES: every instance's
endpoint name, comma-separated (a restarted instance has a new one; `Rewire` updates them). A
TP rank other than 0 hosts no stage: it mirrors rank 0's calls.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import pickle
import signal
import stat
import sys
import threading
from pathlib import Path
from typing import Any

from omni_server.compiler.plan import Plan
from omni_server.gpu.weights import WeightSharing
from omni_server.wire import codec
from omni_server.wire.channels import COORDINATOR, Endpoint
from omni_server.wire.heartbeats import SOCKET_NAME, HeartbeatSender
from omni_server.wire.links import ChannelLinks
from omni_server.wire.messages import Ready, Rewire, Rewired, Shutdown, StartFailed
from omni_server.wire.routes import Routes

from .host import StageHost, StageStartError, bind_thread_to_device

log = logging.getLogger("omni_server.worker")

_PR_SET_PDEATHSIG = 1
# how long closing the endpoint may spend delivering StartFailed before the process exits
_LAST_WORD_S = 2.0
PREPARED_DIR = "prepared"  # in the run directory: StageContext.prepared_dir


def die_with_parent(parent_pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os._exit(1)


async def serve(
    plan: Plan, run_dir: Path, run_id: str, index: int, port: int | None, names: list[str]
) -> int:
    instance = plan.instances[index]
    routes = Routes(plan)
    peer_devices = {  # CUDA IPC engages towards peers' first lives only (names change later)
        names[n]: frozenset(d for d in inst.devices.values() if d is not None)
        for n, inst in enumerate(plan.instances)
        if n != index
    }
    endpoint = Endpoint(run_dir, run_id, names[index], _ring_capacity(), peer_devices)
    codec.set_local_devices(frozenset(d for d in instance.devices.values() if d is not None))
    senders = [names[i] for i in sorted(routes.senders_to(index))]
    if routes.takes_entries(index):
        senders.append(COORDINATOR)
    endpoint.create_inbound(senders)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        if instance.tp_rank > 0:
            return await _serve_tp_peer(plan, index, endpoint, stop, port)
        group = control = None
        calls_factory: Any = None
        if instance.tp_size > 1:
            group, control = await _join_tp(plan, index, port)
            from .tp import TPLeaderCalls

            def calls_factory(spec: Any, backend: Any) -> Any:
                return TPLeaderCalls(spec, backend, control)

        kwargs = {"calls_factory": calls_factory} if calls_factory else {}
        sharing = WeightSharing(plan, index, run_dir, run_id)
        if sharing.active:  # this replica leads or follows a weight-sharing group
            kwargs["weight_sharing"] = sharing
        links = ChannelLinks(endpoint, name=names.__getitem__)
        host = StageHost(
            plan,
            index,
            links,
            routes=routes,
            process_group=group,
            prepared_dir=prepared_dir(run_dir),
            **kwargs,
        )
        try:
            await host.start()
        except StageStartError as exc:
            endpoint.send_control(COORDINATOR, StartFailed(instance.name, str(exc)), _LAST_WORD_S)
            return 1

        def on_message(message: Any) -> None:
            if isinstance(message, Rewire):
                host.spawn(_rewire(message, endpoint, names, routes, index))
            else:
                host.handle(message)

        endpoint.start_receiving(on_message, lambda _: host.shutdown_requested.set())
        endpoint.send_control(COORDINATOR, Ready(instance.name))
        waiters = [asyncio.ensure_future(e.wait()) for e in (stop, host.shutdown_requested)]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
        await host.stop()
        await endpoint.flush()
        return 0
    finally:
        await endpoint.close()


async def _rewire(
    message: Rewire, endpoint: Endpoint, names: list[str], routes: Routes, index: int
) -> None:
    """A peer restarts under a new name: forget the old one's rings and socket, receive from
    the new one if it sends to us, then confirm (the successor is spawned after that)."""
    await endpoint.forget_peer(message.old)
    names[message.index] = message.new
    if message.index in routes.senders_to(index):
        endpoint.add_inbound(message.new)
    endpoint.send_control(COORDINATOR, Rewired(routes.plan.instances[index].name, message.index))


async def _join_tp(plan: Plan, index: int, port: int | None) -> tuple[Any, Any]:
    from .tp import init_process_group

    instance = plan.instances[index]
    assert port is not None, "a TP instance needs a rendezvous port"
    (stage,) = instance.stages  # a TP stage owns its process
    return await asyncio.to_thread(
        init_process_group, instance.tp_rank, instance.tp_size, port, instance.devices[stage]
    )


async def _serve_tp_peer(
    plan: Plan, index: int, endpoint: Endpoint, stop: asyncio.Event, port: int | None
) -> int:
    from .scheduling import StageCalls
    from .tp import follow

    instance = plan.instances[index]
    group, control = await _join_tp(plan, index, port)
    host = StageHost(plan, index, ChannelLinks(endpoint), process_group=group)
    (stage,) = instance.stages
    try:
        backend = await host.initialize_backend(stage)
    except StageStartError as exc:
        endpoint.send_control(COORDINATOR, StartFailed(instance.name, str(exc)), _LAST_WORD_S)
        return 1
    calls = StageCalls(plan.stages[stage], backend)
    done = asyncio.get_running_loop().create_future()

    def finished() -> None:
        if not done.done():
            done.set_result(None)

    def run() -> None:
        try:
            bind_thread_to_device(instance.devices[stage])
            follow(calls, control)
        finally:
            loop.call_soon_threadsafe(finished)

    loop = asyncio.get_running_loop()
    threading.Thread(target=run, name=f"tp-peer-{stage}", daemon=True).start()

    def on_message(message: Any) -> None:
        if isinstance(message, Shutdown):
            stop.set()

    endpoint.start_receiving(on_message, lambda _: stop.set())
    endpoint.send_control(COORDINATOR, Ready(instance.name))
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([done, stopper], return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not done.done():  # told to stop: give the leader's finalize a moment to reach us
        await asyncio.wait([done], timeout=2.0)
    return 0


def prepared_dir(run_dir: Path) -> Path | None:
    """The run's directory for prepared weights (StageContext.prepared_dir), `prepared/` in
    the run directory, made private on first use. It is trusted only if it is a directory of
    this user with mode 0700 (not a link): else None, with a warning (loads prepare afresh)."""
    path = run_dir / PREPARED_DIR
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        st = path.lstat()
    except OSError as exc:
        log.warning("no prepared weights: %s: %s", path, exc)
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        log.warning("no prepared weights: %s is not a private directory of this user", path)
        return None
    return path


def _ring_capacity() -> int:
    return int(os.environ.get("OMNI_RING_CAPACITY", str(8 << 20)))


def main(argv: list[str]) -> int:
    run_dir, run_id, index, parent = Path(argv[0]), argv[1], int(argv[2]), int(argv[3])
    port = int(argv[4]) if len(argv) > 4 and argv[4] else None
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us
    beat_s = float(os.environ.get("OMNI_HEARTBEAT_S", "0"))
    if beat_s > 0:  # first: a slow start (imports, model loading) still beats
        HeartbeatSender(run_dir / SOCKET_NAME, beat_s).start()
    with open(run_dir / "plan.pkl", "rb") as f:
        plan: Plan = pickle.load(f)
    names = argv[5].split(",") if len(argv) > 5 else [str(i) for i in range(len(plan.instances))]
    if len(names) != len(plan.instances):
        raise SystemExit(f"worker: {len(names)} endpoint names for {len(plan.instances)} instances")
    name = plan.instances[index].name
    logging.basicConfig(
        level=os.environ.get("OMNI_LOG_LEVEL", "WARNING"),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    code = asyncio.run(serve(plan, run_dir, run_id, index, port, names))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a TP peer thread may still sit in a collective: do not wait for it


if __name__ == "__main__":
    main(sys.argv[1:])
