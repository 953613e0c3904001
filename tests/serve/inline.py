"""The app in-process over a real inline runtime, for the HTTP layer's own tests.

The stage is the stand-in of tests/fixtures/serve_stand_in.py (silence, or a failure, no audio,
or a slow stream, as the text says); everything else is real: the compiler, the runtime, the
app with its middlewares, and either aiohttp's test client or a real listening socket served by
`make_runner` (the connection handler the server uses).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from omni_server.compiler.compiler import compile_repository
from omni_server.pipeline import Runtime
from omni_server.serve.options import ServeOptions
from omni_server.serve.timeouts import make_runner
from tests.fixtures import FIXTURES
from tests.helpers.repo import make_repo, toml

MODEL = "quiet"
SPEECH = {"model": MODEL, "input": "hello there", "voice": "hush", "response_format": "pcm"}


def stand_in_repo(root: Path) -> Path:
    return make_repo(
        root,
        stages={
            "speaker": toml("""
                backend = "StandIn"
                terminal = true
                [scheduler]
                kind = "stream"
                """)
        },
        repository=toml(f"""
            [models.{MODEL}]
            entry = "speaker"
            tasks = ["speech"]
            voices = ["hush"]
            default_voice = "hush"
            """),
        models={"speaker": FIXTURES / "serve_stand_in.py"},
    )


@contextlib.asynccontextmanager
async def inline_runtime(root: Path) -> AsyncIterator[Runtime]:
    runtime = Runtime(compile_repository(stand_in_repo(root)), inline=True)
    await runtime.start()
    try:
        yield runtime
    finally:
        await runtime.stop()


@contextlib.asynccontextmanager
async def listening(app: web.Application, options: ServeOptions) -> AsyncIterator[int]:
    """Serve `app` on a free loopback port with the server's own connection handling."""
    runner = make_runner(app, options)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        address = runner.addresses[0]
        yield int(address[1])
    finally:
        await runner.cleanup()
