"""Back-pressure to slow readers: a terminal stage sends at most CHUNK_WINDOW chunks of a request
that its consumer has not taken, so a slow reader pauses its request at the stage instead of
growing the server; a consumer that only awaits the result is not paced (nothing deadlocks)."""

from __future__ import annotations

import asyncio

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.wire.messages import CHUNK_WINDOW
from tests.helpers.repo import make_repo, toml
from tests.helpers.runtime import running

pytestmark = pytest.mark.timeout(120)

GUSH = '''\
from omni_server.backend import StageBackend


class Gush(StageBackend):
    """Streams n chunks of `size` bytes as fast as it can."""

    def generate(self, request):
        for i in range(request.inputs["n"]):
            yield {"i": i, "data": bytes(request.inputs["size"])}
        return {"n": request.inputs["n"]}
'''


def _plan(root):
    stage = toml("""
        backend = "Gush"
        terminal = true
        [scheduler]
        kind = "stream"
    """)
    make_repo(
        root,
        {"gush": stage},
        toml("""
            [models.m]
            entry = "gush"
            tasks = ["speech"]
        """),
        {"gush": GUSH},
    )
    return compile_repository(root)


@pytest.mark.parametrize("inline", [False, True], ids=["process", "inline"])
async def test_a_slow_reader_pauses_its_stream_and_bounds_what_the_server_holds(tmp_path, inline):
    plan = _plan(tmp_path)
    n, size = 300, 64 << 10  # 19 MB in all; at most CHUNK_WINDOW x 64 KiB held at once
    async with running(plan, inline=inline) as runtime:
        handle = runtime.submit(plan.models["m"], {"n": n, "size": size})
        waiting, seen = [], []
        async for chunk in handle:
            waiting.append(handle.buffered_chunks)  # what the server holds for this reader
            seen.append(chunk["i"])
            assert len(chunk["data"]) == size
            # a slow reader: the stage is far faster; the bound below holds at any speed
            await asyncio.sleep(0.002)
        assert seen == list(range(n))  # paced, not dropped: every chunk, in order
        assert max(waiting) < CHUNK_WINDOW  # the one just taken is not waiting any more
        assert max(waiting) >= CHUNK_WINDOW // 2  # the stage was ahead: the window held it
        assert await handle.result() == {"n": n}


async def test_a_reader_of_the_result_alone_is_not_paced(tmp_path):
    plan = _plan(tmp_path)
    async with running(plan) as runtime:
        handle = runtime.submit(plan.models["m"], {"n": 5 * CHUNK_WINDOW, "size": 16})
        assert await handle.result() == {"n": 5 * CHUNK_WINDOW}  # no credit ever returned
        assert [c["i"] async for c in handle] == list(range(5 * CHUNK_WINDOW))
