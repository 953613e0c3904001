"""Batched stream chunks: an `ar` stage's step sends its chunks for one destination process as
one StreamChunks message, split back into per-request chunks on arrival, in order; a stream
aborted in the middle of a batched run ends alone; a malformed or truncated batch is refused
whole (nothing of it delivered)."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.envelope import Envelope
from omni_server.pipeline import PipelineError
from omni_server.stage.host import StageHost
from omni_server.wire.codec import decode, encode
from omni_server.wire.messages import (
    MAX_BATCHED_CHUNKS,
    MalformedMessage,
    Skipped,
    StreamChunk,
    StreamChunks,
    split_chunks,
)
from tests.fixtures import FIXTURES
from tests.helpers.repo import make_repo, toml
from tests.helpers.runtime import running

pytestmark = pytest.mark.timeout(120)

COUNTER = """\
backend = "model.py:Counter"
process = "engine"
stream_to = ["relay"]
[scheduler]
kind = "ar"
"""

RELAY = """\
backend = "model.py:Relay"
process = "sink"
terminal = true
[scheduler]
kind = "stream"
"""


def _plan(root):
    make_repo(
        root,
        {"counter": COUNTER, "relay": RELAY},
        toml("""
            [models.m]
            entry = "counter"
            tasks = ["chat"]
        """),
        {"counter": FIXTURES / "ar_stages.py", "relay": FIXTURES / "ar_stages.py"},
    )
    return compile_repository(root)


def _chunk(key: int, seq: int = 0, stage: str = "relay", source: str = "counter") -> StreamChunk:
    return StreamChunk(Envelope(key, f"r{key}", {}, "m"), stage, source, seq, {"i": seq})


class _Recorder:
    """Links that keep what a host sends (no transport)."""

    def __init__(self) -> None:
        self.data: list[tuple[int, Any]] = []

    def to_instance(self, index: int, message: Any) -> None:
        self.data.append((index, message))

    def control(self, index: int, message: Any) -> None:
        raise AssertionError("no control expected")

    def to_coordinator(self, message: Any) -> None:
        self.data.append((-1, message))


def _index(plan, process: str) -> int:
    return next(i for i, inst in enumerate(plan.instances) if inst.process == process)


# ---- the message and its checks --------------------------------------------------------------


def test_a_batch_splits_into_its_chunks_in_order_after_crossing_as_bytes():
    batch = StreamChunks("relay", "counter", tuple(_chunk(k, seq=k) for k in (7, 3, 9)))
    header, buffers = encode(batch)
    received = decode(header, buffers)
    chunks = split_chunks(received)
    assert [(c.env.key, c.seq, c.chunk) for c in chunks] == [
        (7, 7, {"i": 7}),
        (3, 3, {"i": 3}),
        (9, 9, {"i": 9}),
    ]


@pytest.mark.parametrize(
    "batch",
    [
        StreamChunks("relay", "counter", ()),
        StreamChunks("relay", "counter", [_chunk(1)]),  # type: ignore[arg-type]
        StreamChunks("relay", "counter", (_chunk(1), _chunk(2, stage="other"))),
        StreamChunks("relay", "counter", (_chunk(1), _chunk(2, source="elsewhere"))),
        StreamChunks("relay", "counter", (_chunk(1), _chunk(2, seq=-1))),
        StreamChunks("relay", "counter", (_chunk(1), Skipped(_chunk(2).env, "relay", "x"))),  # type: ignore[arg-type]
        StreamChunks(b"relay", "counter", (_chunk(1),)),  # type: ignore[arg-type]
        StreamChunks("relay", "counter", (_chunk(0),) * (MAX_BATCHED_CHUNKS + 1)),
    ],
    ids=["empty", "list", "stage", "source", "seq", "entry", "name", "too-many"],
)
def test_a_malformed_batch_is_refused_whole(batch):
    with pytest.raises(MalformedMessage):
        split_chunks(decode(*encode(batch)))


def test_a_truncated_batch_does_not_decode():
    header, buffers = encode(StreamChunks("relay", "counter", (_chunk(1), _chunk(2))))
    for cut in (1, len(header) // 2, len(header) - 1):
        with pytest.raises((pickle.UnpicklingError, EOFError, ValueError)):
            decode(header[:cut], buffers)


# ---- the host: one message per destination process ------------------------------------------


def test_a_steps_chunks_for_one_process_leave_as_one_message(tmp_path):
    plan = _plan(tmp_path)
    links = _Recorder()
    host = StageHost(plan, _index(plan, "engine"), links)  # type: ignore[arg-type]
    chunks = [_chunk(k, seq=s) for k, s in ((1, 0), (2, 5), (3, 1))]
    host.send_chunks("relay", chunks)
    host.send_chunks("relay", [_chunk(4)])  # a lone chunk goes as itself
    sink = _index(plan, "sink")
    assert [(i, type(m).__name__) for i, m in links.data] == [
        (sink, "StreamChunks"),
        (sink, "StreamChunk"),
    ]
    batch = links.data[0][1]
    assert (batch.stage, batch.source) == ("relay", "counter")
    assert [(c.env.key, c.seq) for c in batch.chunks] == [(1, 0), (2, 5), (3, 1)]


def test_a_host_refuses_a_batch_for_a_stage_it_does_not_host(tmp_path):
    plan = _plan(tmp_path)
    host = StageHost(plan, _index(plan, "engine"), _Recorder())  # type: ignore[arg-type]
    with pytest.raises(MalformedMessage, match="not hosted"):
        host.handle(StreamChunks("relay", "counter", (_chunk(1), _chunk(2))))


# ---- served: split, order, abort of one stream of the batch ----------------------------------


async def test_batched_streams_arrive_whole_and_in_order_and_one_aborts_alone(tmp_path):
    async with running(_plan(tmp_path)) as runtime:
        model = runtime.plan.models["m"]
        doomed = runtime.submit(model, {"n": 10**9}, request_id="doomed")
        doomed_chunks = aiter(doomed)
        await anext(doomed_chunks)  # running: the others' steps batch with it
        lengths = {f"s{i}": 20 + 7 * i for i in range(6)}
        streams = {
            rid: runtime.submit(model, {"n": n}, request_id=rid) for rid, n in lengths.items()
        }

        async def read(rid: str) -> tuple[list[dict], dict]:
            chunks = [c async for c in streams[rid]]
            return chunks, await streams[rid].result()

        readers = {rid: asyncio.create_task(read(rid)) for rid in streams}
        for _ in range(10):
            await anext(doomed_chunks)
        await doomed.abort()
        with pytest.raises(PipelineError) as err:
            await doomed.result()
        done = {rid: await asyncio.wait_for(task, 60) for rid, task in readers.items()}
        after = await asyncio.wait_for(runtime.submit(model, {"n": 3}).result(), 30)
    assert err.value.code == "aborted"
    for rid, (chunks, result) in done.items():
        n = lengths[rid]
        assert [c["i"] for c in chunks] == list(range(n)), rid  # none lost, none reordered
        assert [c["at"] for c in chunks] == list(range(n)), rid
        assert {c["request"] for c in chunks} == {rid}  # each split to its own stream
        assert result == {"relayed": n}
    assert after == {"relayed": 3}
