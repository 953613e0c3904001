"""The stream scheduler's first-chunk lane: a new request's first chunk runs beside another
request's step in progress, not behind it (`[scheduler] first_chunk_lane = true`).

The backend below blocks every step on a gate the test opens, and records which step started
on which thread, so every assertion is about the order of events, never about time. These run
inline (stage hosts in this process), so the test reaches the backend object itself.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.errors import RepositoryError
from omni_server.pipeline import PipelineError
from omni_server.stage.compute import ComputeExecutor
from omni_server.stage.scheduling import WorkItem
from omni_server.stage.scheduling.stream import ActiveRequest, pick, pick_first
from omni_server.stage.streams import StreamInbox
from tests.helpers.repo import make_repo, toml
from tests.helpers.runtime import running

pytestmark = pytest.mark.timeout(60)

GATED = '''\
import threading
from omni_server.backend import StageBackend


class Gated(StageBackend):
    """Step i of request `name` sets started[name:i], then waits for gates[name:i]."""

    def initialize(self, context):
        self.lock = threading.Lock()
        self.started = {}
        self.gates = {}
        self.order = []  # ("start" | "end", "name:i") in the order the steps ran
        self.closed = {}  # name -> the thread its generator's finally ran on

    def event(self, table, key):
        with self.lock:
            return table.setdefault(key, threading.Event())

    def generate(self, request):
        name, steps = request.inputs["name"], request.inputs["steps"]
        try:
            for i in range(steps):
                key = f"{name}:{i}"
                self.order.append(("start", key))
                self.event(self.started, key).set()
                if not self.event(self.gates, key).wait(20):
                    raise TimeoutError(f"the test never opened {key}")
                self.order.append(("end", key))
                if request.inputs.get("fail_at") == i:
                    raise ValueError(f"{name} failed at step {i}")
                yield {"name": name, "i": i, "thread": threading.current_thread().name}
        finally:
            self.closed[name] = threading.current_thread().name
        return {"name": name}
'''

MAIN, LANE = "stage-gated_", "stage-gated-first_"  # thread name prefixes (ThreadPoolExecutor)


def _plan(root, lane: bool = True):
    scheduler = toml(f"""
        [scheduler]
        kind = "stream"
        first_chunk_lane = {str(lane).lower()}
    """)
    make_repo(
        root,
        {
            "gated": toml("""
                backend = "model.py:Gated"
                terminal = true
            """)
            + scheduler
        },
        toml("""
            [models.m]
            entry = "gated"
            tasks = ["speech"]
        """),
        {"gated": GATED},
    )
    return compile_repository(root)


def _backend(runtime) -> Any:
    return runtime.inline_pipeline.backend("gated")


def _stage(runtime) -> Any:
    return runtime.inline_pipeline.stage("gated")


async def _started(backend, key: str) -> None:
    assert await asyncio.to_thread(backend.event(backend.started, key).wait, 20), key


def _open(backend, key: str) -> None:
    backend.event(backend.gates, key).set()


async def _busy_with_long_step(runtime, backend):
    """Request `a`: its first chunk done, its second step running on the main thread."""
    model = runtime.plan.models["m"]
    a = runtime.submit(model, {"name": "a", "steps": 2})
    _open(backend, "a:0")
    first = await anext(aiter(a))
    assert first["thread"].startswith(MAIN)  # an idle main thread takes a first chunk itself
    await _started(backend, "a:1")
    return a


async def _gone(runtime, key: int) -> None:
    """The stage has processed the abort of request `key` (the broadcast is asynchronous)."""
    stage = _stage(runtime)
    for _ in range(2000):
        if not stage.holds(key):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"request {key} is still at the stage")


async def test_first_chunk_runs_beside_a_step_in_progress(tmp_path):
    async with running(_plan(tmp_path), inline=True) as runtime:
        backend = _backend(runtime)
        a = await _busy_with_long_step(runtime, backend)
        b = runtime.submit(runtime.plan.models["m"], {"name": "b", "steps": 2})
        await _started(backend, "b:0")  # while a:1 still waits for its gate
        _open(backend, "b:0")
        b_first = await anext(aiter(b))
        assert b_first["thread"].startswith(LANE)
        assert ("end", "a:1") not in backend.order  # b's first chunk came out during a:1
        # b's later chunk is not a first chunk: it waits for the main thread, behind a:1
        _open(backend, "b:1")
        _open(backend, "a:1")
        rest = [c async for c in b]
        assert [c["i"] for c in rest] == [1] and rest[0]["thread"].startswith(MAIN)
        assert await b.result() == {"name": "b"}
        assert await a.result() == {"name": "a"}
        assert backend.order.index(("end", "a:1")) < backend.order.index(("start", "b:1"))


async def test_without_the_lane_a_first_chunk_waits_for_the_step_in_progress(tmp_path):
    async with running(_plan(tmp_path, lane=False), inline=True) as runtime:
        backend = _backend(runtime)
        a = await _busy_with_long_step(runtime, backend)
        b = runtime.submit(runtime.plan.models["m"], {"name": "b", "steps": 1})
        _open(backend, "b:0")
        _open(backend, "a:1")
        assert (await anext(aiter(b)))["thread"].startswith(MAIN)
        await asyncio.gather(a.result(), b.result())
        assert backend.order.index(("end", "a:1")) < backend.order.index(("start", "b:0"))


async def test_several_first_chunks_take_turns_on_the_lane(tmp_path):
    """One lane thread: two new first chunks during a long step run one after the other."""
    async with running(_plan(tmp_path), inline=True) as runtime:
        backend = _backend(runtime)
        model = runtime.plan.models["m"]
        a = await _busy_with_long_step(runtime, backend)
        b = runtime.submit(model, {"name": "b", "steps": 1})
        c = runtime.submit(model, {"name": "c", "steps": 1})
        await _started(backend, "b:0")
        assert ("start", "c:0") not in backend.order  # the lane is busy, the main thread too
        _open(backend, "b:0")
        await _started(backend, "c:0")
        _open(backend, "c:0")
        assert (await anext(aiter(c)))["thread"].startswith(LANE)
        assert ("end", "a:1") not in backend.order
        _open(backend, "a:1")
        assert [r["name"] for r in await asyncio.gather(a.result(), b.result(), c.result())] == [
            "a",
            "b",
            "c",
        ]


async def test_abort_during_a_lane_step_closes_the_generator_on_the_main_thread(tmp_path):
    async with running(_plan(tmp_path), inline=True) as runtime:
        backend = _backend(runtime)
        a = await _busy_with_long_step(runtime, backend)
        b = runtime.submit(runtime.plan.models["m"], {"name": "b", "steps": 3})
        await _started(backend, "b:0")
        await b.abort()
        await _gone(runtime, b.key)
        _open(backend, "b:0")  # the step returns a chunk for a request that is gone
        assert "b" not in backend.closed  # closing waits for the main thread (busy with a:1)
        _open(backend, "a:1")
        assert await a.result() == {"name": "a"}
        for _ in range(2000):  # the close was queued behind a:1 on the main thread
            if "b" in backend.closed:
                break
            await asyncio.sleep(0.005)
        assert backend.closed["b"].startswith(MAIN)
        assert ("start", "b:1") not in backend.order  # never stepped again
        with pytest.raises(PipelineError) as err:
            await b.result()
        assert err.value.code == "aborted"
        assert _stage(runtime).idle


async def test_abort_of_the_main_step_leaves_the_lane_serving(tmp_path):
    async with running(_plan(tmp_path), inline=True) as runtime:
        backend = _backend(runtime)
        a = await _busy_with_long_step(runtime, backend)
        b = runtime.submit(runtime.plan.models["m"], {"name": "b", "steps": 1})
        await _started(backend, "b:0")
        await a.abort()
        await _gone(runtime, a.key)
        _open(backend, "b:0")
        assert (await anext(aiter(b)))["thread"].startswith(LANE)
        assert ("end", "a:1") not in backend.order  # b's first chunk came while a:1 ran
        _open(backend, "a:1")
        # b's end (its generator's return) is a later step: the main thread's, after a:1
        assert await b.result() == {"name": "b"}
        with pytest.raises(PipelineError) as err:
            await a.result()
        assert err.value.code == "aborted"
        for _ in range(2000):
            if "a" in backend.closed:
                break
            await asyncio.sleep(0.005)
        assert backend.closed["a"].startswith(MAIN)
        assert _stage(runtime).idle


@pytest.mark.parametrize("failing", ["lane", "main"])
async def test_an_exception_in_either_lane_fails_only_its_request(tmp_path, failing):
    async with running(_plan(tmp_path), inline=True) as runtime:
        backend = _backend(runtime)
        model = runtime.plan.models["m"]
        fail_a = {"fail_at": 1} if failing == "main" else {}
        a = runtime.submit(model, {"name": "a", "steps": 2, **fail_a})
        _open(backend, "a:0")
        await anext(aiter(a))
        await _started(backend, "a:1")
        fail_b = {"fail_at": 0} if failing == "lane" else {}
        b = runtime.submit(model, {"name": "b", "steps": 1, **fail_b})
        await _started(backend, "b:0")
        failed, ok = (b, a) if failing == "lane" else (a, b)
        _open(backend, "b:0" if failing == "lane" else "a:1")
        with pytest.raises(PipelineError) as err:
            await failed.result()
        assert err.value.code == "stage_failed" and err.value.stage == "gated"
        assert "failed at step" in err.value.message
        _open(backend, "a:1" if failing == "lane" else "b:0")
        assert (await ok.result())["name"] in ("a", "b")
        # the stage still serves, on both threads
        c = runtime.submit(model, {"name": "c", "steps": 1})
        _open(backend, "c:0")
        assert await c.result() == {"name": "c"}


def test_the_lane_needs_a_stream_scheduler(tmp_path):
    make_repo(
        tmp_path,
        {
            "s": toml("""
                backend = "S"
                terminal = true
                [scheduler]
                first_chunk_lane = true
            """)
        },
        toml("""
            [models.m]
            entry = "s"
            tasks = ["speech"]
        """),
    )
    with pytest.raises(RepositoryError) as err:
        compile_repository(tmp_path)
    assert "first_chunk_lane" in str(err.value) and 'kind = "stream"' in str(err.value)


def test_the_stage_watchdog_sees_a_call_on_the_lane_thread():
    """The sibling thread publishes its running call to the stage executor's `current`."""
    main = ComputeExecutor("stage-x")
    lane = main.sibling("-first")
    release = threading.Event()
    try:
        assert main.current is None
        running_call = lane.submit(release.wait, 20)
        for _ in range(2000):
            if main.current is not None:
                break
            time.sleep(0.005)
        number, started = main.current or (0, 0.0)
        assert number >= 1 and started <= time.monotonic()
        release.set()
        assert running_call.result(20) is True
        main.submit(lambda: None).result(20)
        assert main.current is None and lane.current is None
    finally:
        release.set()
        main.shutdown(wait=True)
    with pytest.raises(RuntimeError):  # shut down with the stage's executor
        lane.submit(lambda: None)


class _Stream:
    """A stream input as the scheduler sees it (the runtime's StreamInbox has these two)."""

    def __init__(self, ready: bool, drained: bool) -> None:
        self.ready, self.drained = ready, drained


def _active(key: int, stream: _Stream | None, chunks: int = 0) -> ActiveRequest:
    env = SimpleNamespace(key=key)  # the scheduler reads only the key of an envelope
    item = WorkItem(env=env, request=None, timings=[], stream=stream)  # type: ignore[arg-type]
    return ActiveRequest(item, chunks=chunks)


def test_pick_order_first_chunks_then_finishing_requests_then_fewest_chunks():
    """The main thread's order: a request's first chunk; then a request whose stream input is
    all read (its next step ends it, so its caller is freed at once instead of every request
    finishing together); then the fewest chunks; ties to the oldest."""
    admitted = [  # in admission order
        _active(1, _Stream(ready=True, drained=False), chunks=3),  # more input waiting
        _active(2, _Stream(ready=True, drained=False), chunks=1),  # more input waiting
        _active(3, _Stream(ready=True, drained=True), chunks=2),  # its input all read
        _active(4, _Stream(ready=False, drained=False)),  # no chunk yet, but nothing to read
        _active(5, None),  # no stream input: always runnable
    ]
    order = []
    while (active := pick(admitted)) is not None:
        order.append(active.item.key)
        admitted.remove(active)
    assert order == [5, 3, 2, 1]  # 4 is not runnable


def test_the_lane_picks_only_first_chunks_of_requests_not_running():
    """The lane's order (asked only while the main thread is busy: an idle main thread takes a
    first chunk itself, as test_first_chunk_runs_beside_a_step_in_progress sees)."""
    first, later = _active(6, None), _active(7, _Stream(ready=True, drained=False), chunks=1)
    admitted = [first, later]
    assert pick_first(admitted) is first
    first.running = True  # a step of it is in flight on the other thread
    assert pick_first(admitted) is None and pick(admitted) is later


def test_a_stream_inbox_is_drained_once_its_end_is_all_that_is_left():
    inbox = StreamInbox("r", ["up"])
    inbox.put({"i": 0})
    assert inbox.ready and not inbox.drained  # a chunk is waiting
    inbox.end("up", [])
    assert not inbox.drained  # the chunk is still unread
    reader = iter(inbox)
    assert next(reader) == {"i": 0}
    assert inbox.drained  # only the end is left: the next read returns
    assert list(reader) == [] and inbox.drained  # the end marker is sticky


def test_the_lane_is_refused_on_a_tensor_parallel_stage(tmp_path):
    """TP ranks mirror the leader's backend calls one at a time, in one order."""
    stage = toml("""
        backend = "S"
        terminal = true
        tp_size = 2
        [scheduler]
        kind = "stream"
    """)
    make_repo(
        tmp_path,
        {"s": stage + "first_chunk_lane = true\n"},
        toml("""
            [models.m]
            entry = "s"
            tasks = ["speech"]
        """),
    )
    with pytest.raises(RepositoryError) as err:
        compile_repository(tmp_path)
    assert "first_chunk_lane" in str(err.value) and "tp_size = 2" in str(err.value)
