"""Supervision with real processes: a killed or frozen stage process is restarted (backoff,
crash-loop limit) while its replicas keep serving, and a stage's timeout_s fails requests (and
restarts a process whose backend call overran). Nothing leaks across a restart.

Tests wait on the runtime's supervision events (`supervision_observers`), never on sleeps; the
timeouts given to `asyncio.wait_for` only keep a broken build from hanging the suite.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
from pathlib import Path

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.pipeline import PipelineError, Runtime
from omni_server.pipeline.supervision import CrashHistory, InstanceState, SupervisionPolicy
from tests.helpers.pipelines import chain
from tests.helpers.proc import alive, mapped_segments, run_segments
from tests.helpers.runtime import running

pytestmark = pytest.mark.timeout(120)

_EVENT_WAIT_S = 60.0  # a safety net only: events come in about a second


class Events:
    """The runtime's supervision events, awaited in order."""

    def __init__(self, runtime: Runtime) -> None:
        self.queue: asyncio.Queue[tuple[str, str, str]] = asyncio.Queue()
        runtime.supervision_observers.append(lambda *e: self.queue.put_nowait(e))

    async def next(self, kind: str, subject: str) -> str:
        """The detail of the next event of `kind` about `subject` (others are skipped)."""
        while True:
            event = await asyncio.wait_for(self.queue.get(), _EVENT_WAIT_S)
            if event[:2] == (kind, subject):
                return event[2]


def _replica_of_b(result: dict) -> int:
    return result["trace"][1][1]  # trace: [stage, replica, pid] per stage a, b, c


def _renamed(segments: list[str], old: str, new: str) -> set[str]:
    """Ring names with endpoint `old` renamed `new` (omni-RUN-SENDER-RECEIVER)."""
    out = set()
    for name in segments:
        prefix, run, sender, receiver = name.split("-")
        sender = new if sender == old else sender
        receiver = new if receiver == old else receiver
        out.add(f"{prefix}-{run}-{sender}-{receiver}")
    return out


def _descriptors(pid: int) -> collections.Counter[str]:
    """Descriptors of `pid` that a restart could leak, by kind: pidfds, eventfds, epolls, ring
    doorbells, shared-memory files. (ZMQ's connections are left out: it opens them lazily.)"""
    doorbells = {
        line.split()[6]
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]
        if "@omni-ring-" in line
    }
    kinds: collections.Counter[str] = collections.Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("anon_inode:"):
            kinds[target] += 1
        elif target.startswith("socket:[") and target[8:-1] in doorbells:
            kinds["doorbell"] += 1
        elif target.startswith("/dev/shm/"):
            kinds["shm"] += 1
    return kinds


async def _use_every_path(runtime: Runtime, model) -> None:
    """Requests through every replica, and aborts (control sockets to every instance), so that
    descriptor counts taken before and after compare like with like."""
    results = await asyncio.gather(
        *(runtime.submit(model, {"values": [i]}).result() for i in range(6))
    )
    assert {_replica_of_b(r) for r in results} == {0, 1, 2}
    for i in range(6):
        await runtime.submit(model, {"values": [i], "sleep": 1}).abort()


async def test_a_killed_replica_restarts_while_the_others_serve(tmp_path):
    plan = chain(tmp_path, "replicated")  # a x2, bc x3: bc@r1 is instance 3
    assert plan.instances[3].name == "bc@r1"
    async with running(plan, supervision=SupervisionPolicy(backoff_s=1.0)) as runtime:
        events = Events(runtime)
        model = plan.models["m"]
        run_id = runtime.stage_processes.run_id
        await _use_every_path(runtime, model)
        segments_before = run_segments(run_id)
        peer = runtime.processes()["a@r0"]  # sends to bc@r1
        peer_fds, server_fds = _descriptors(peer), _descriptors(os.getpid())
        assert peer_fds["doorbell"] >= 4  # a@r0's rings: from the coordinator, to bc@r0..2
        victim = runtime.processes()["bc@r1"]

        held = [runtime.submit(model, {"values": [i], "sleep": 0.1}) for i in range(6)]
        os.kill(victim, signal.SIGKILL)
        assert await events.next("death", "bc@r1") == "exit code -9"
        assert runtime.health() == ("degraded", "bc@r1 restarting")  # the backoff is 1 s
        # bound now, while bc@r1 is down: to the live replicas only
        during = [runtime.submit(model, {"values": [i]}) for i in range(6)]
        outcomes = await asyncio.gather(*(h.result() for h in held), return_exceptions=True)
        failed = [o for o in outcomes if isinstance(o, PipelineError)]
        assert len(failed) == 2  # round robin over three replicas: two of six were bound to r1
        assert all(e.code == "process_died" and "bc@r1" in e.message for e in failed)
        assert all(_replica_of_b(o) != 1 for o in outcomes if isinstance(o, dict))

        bound_during = await asyncio.gather(*(h.result() for h in during))
        assert {_replica_of_b(r) for r in bound_during} == {0, 2}

        await events.next("restart", "bc@r1")
        assert runtime.health()[0] == "ok" and runtime.restarts["bc@r1"] == 1
        successor = runtime.processes()["bc@r1"]
        assert successor != victim and not alive(victim)
        after = await asyncio.gather(
            *(runtime.submit(model, {"values": [i]}).result() for i in range(6))
        )
        assert {_replica_of_b(r) for r in after} == {0, 1, 2}  # the successor serves again
        assert {r["trace"][1][2] for r in after if _replica_of_b(r) == 1} == {successor}
        assert all(r["values"] == [r["values"][0], 1, 2, 3] for r in after)

        # nothing leaked: the dead endpoint's rings are gone, its successor's replace them
        await _use_every_path(runtime, model)
        assert set(run_segments(run_id)) == _renamed(segments_before, "3", "3.1")
        assert not any(name.endswith("-3") or "-3-" in name for name in mapped_segments([peer]))
        assert _descriptors(peer) == peer_fds
        assert _descriptors(os.getpid()) == server_fds


async def test_a_lone_process_restarts_and_its_rings_work_both_ways(tmp_path):
    plan = chain(tmp_path, "split")  # a -> b -> c, one process each: b has no other replica
    async with running(plan, supervision=SupervisionPolicy(backoff_s=0.2)) as runtime:
        events = Events(runtime)
        model = plan.models["m"]
        assert (await runtime.submit(model, {"values": [1]}).result())["values"] == [1, 1, 2, 3]
        victim = runtime.processes()["b@r0"]
        os.kill(victim, signal.SIGKILL)
        await events.next("death", "b@r0")  # the restart waits out a 0.2 s backoff first
        assert runtime.instance_states()["b@r0"] is InstanceState.RESTARTING
        status, detail = runtime.health()
        assert status == "unavailable" and "no live replica of b" in detail
        with pytest.raises(PipelineError) as err:
            runtime.submit(model, {"values": [0]})
        assert err.value.code == "unavailable" and "b@r0" in err.value.message
        await events.next("restart", "b@r0")
        # a -> new b and new b -> c: both directions of the successor's rings carry data
        results = await asyncio.gather(
            *(runtime.submit(model, {"values": [i]}).result() for i in range(5))
        )
        assert [r["values"] for r in results] == [[i, 1, 2, 3] for i in range(5)]
        assert {r["trace"][1][2] for r in results} == {runtime.processes()["b@r0"]} != {victim}


async def test_a_crash_loop_marks_the_instance_failed_and_the_others_keep_serving(tmp_path):
    plan = chain(tmp_path, "replicated")
    policy = SupervisionPolicy(backoff_s=0.05, crash_loop_deaths=2, crash_loop_window_s=600)
    async with running(plan, supervision=policy) as runtime:
        events = Events(runtime)
        model = plan.models["m"]
        os.kill(runtime.processes()["bc@r1"], signal.SIGKILL)
        await events.next("restart", "bc@r1")
        os.kill(runtime.processes()["bc@r1"], signal.SIGKILL)
        reason = await events.next("failed", "bc@r1")
        assert reason == "crash loop: 2 deaths within 600 s"
        assert runtime.instance_states()["bc@r1"] is InstanceState.FAILED
        assert runtime.health() == ("degraded", "bc@r1 failed")
        assert "bc@r1" not in runtime.processes() and not runtime.restarts_pending
        assert (runtime.deaths["bc@r1"], runtime.restarts["bc@r1"]) == (2, 1)
        results = await asyncio.gather(
            *(runtime.submit(model, {"values": [i]}).result() for i in range(9))
        )
        assert {_replica_of_b(r) for r in results} == {0, 2}


async def test_a_frozen_process_is_killed_for_missing_heartbeats_and_restarted(tmp_path):
    plan = chain(tmp_path, "replicated")
    policy = SupervisionPolicy(backoff_s=0.05, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0)
    async with running(plan, supervision=policy) as runtime:
        events = Events(runtime)
        model = plan.models["m"]
        # busy is not frozen: a backend call longer than the heartbeat timeout is left alone
        busy = await runtime.submit(model, {"values": [0], "sleep": 1.3}).result()
        assert busy["values"] == [0, 1, 2, 3] and events.queue.empty()

        victim = runtime.processes()["bc@r1"]
        os.kill(victim, signal.SIGSTOP)
        detail = await events.next("death", "bc@r1")
        assert detail == "frozen: no heartbeat for 1 s"
        assert not alive(victim)  # SIGKILL reaches a stopped process
        await events.next("restart", "bc@r1")
        assert runtime.processes()["bc@r1"] != victim and runtime.health()[0] == "ok"
        results = await asyncio.gather(
            *(runtime.submit(model, {"values": [i]}).result() for i in range(6))
        )
        assert {_replica_of_b(r) for r in results} == {0, 1, 2}


async def test_a_stage_past_its_timeout_fails_the_request_and_a_stuck_call_restarts_it(tmp_path):
    chain(tmp_path, "split")
    plan = compile_repository(tmp_path, ["--stages.a.timeout_s", "0.5"])
    async with running(plan, supervision=SupervisionPolicy(backoff_s=0.05)) as runtime:
        events = Events(runtime)
        model = plan.models["m"]
        stuck = runtime.submit(model, {"values": [0], "sleep": 3600})  # a's call never returns
        with pytest.raises(PipelineError) as err:
            await stuck.result()
        assert (err.value.code, err.value.stage) == ("timeout", "a")
        assert err.value.message == "stage a: no outcome within its timeout_s of 0.5 s"
        assert await events.next("death", "a@r0") == "stage a overran its timeout_s"
        await events.next("restart", "a@r0")
        assert runtime.timeouts["a"] == 1 and runtime.restarts["a@r0"] == 1
        result = await runtime.submit(model, {"values": [7]}).result()
        assert result["values"] == [7, 1, 2, 3]


async def test_timeouts_inline_fail_the_request(tmp_path):
    chain(tmp_path, "one")
    plan = compile_repository(tmp_path, ["--server.stage_timeout_s", "0.2"])
    runtime = Runtime(plan, inline=True)
    await runtime.start()
    try:
        with pytest.raises(PipelineError) as err:
            await runtime.submit(plan.models["m"], {"values": [0], "sleep": 1.0}).result()
        assert (err.value.code, err.value.stage) == ("timeout", "a")
        assert runtime.timeouts["a"] == 1
    finally:
        await runtime.stop()


def test_timeout_of_a_stage_falls_back_to_the_server_default(tmp_path: Path):
    chain(tmp_path, "split")
    assert compile_repository(tmp_path).timeout_of("a") is None  # no limit by default
    plan = compile_repository(
        tmp_path, ["--server.stage_timeout_s", "30", "--stages.b.timeout_s", "0"]
    )
    assert (plan.timeout_of("a"), plan.timeout_of("b")) == (30.0, None)
    plan = compile_repository(tmp_path, ["--stages.c.timeout_s", "2.5"])
    assert (plan.timeout_of("a"), plan.timeout_of("c")) == (None, 2.5)


def test_backoff_doubles_to_its_cap_and_deaths_leave_the_window():
    policy = SupervisionPolicy()
    assert [policy.backoff(n) for n in range(1, 8)] == [0.5, 1, 2, 4, 8, 8, 8]
    history = CrashHistory(window_s=60)
    assert [history.record(now) for now in (0, 10, 59)] == [1, 2, 3]
    assert history.record(now=70.5) == 2  # 0 and 10 are more than 60 s before
