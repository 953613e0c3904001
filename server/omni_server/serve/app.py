"""The aiohttp application: OpenAI-compatible routes over a started `Runtime`.

The app owns no pipeline: `create_app(runtime)` adapts HTTP to `runtime.submit` and reads the
runtime's plan for models and voices. Starting and stopping the runtime is the caller's job
(`omni_server.server.serve`), so tests and embedders can run several apps in one process.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from omni_server.repository.plan import Plan
from omni_server.serve import health, models, speech, transcription
from omni_server.serve.errors import ApiError, openai_errors
from omni_server.serve.metrics import ServerMetrics
from omni_server.serve.state import STATE, ServerState

if TYPE_CHECKING:
    from omni_server.runtime import Runtime

# Speech bodies are small (4096 characters of input, JSON-escaped at worst 12 bytes each); the
# limit leaves room for `instructions` and extension fields and rejects anything bigger with 413.
MAX_BODY_BYTES = 1 << 20
STATIC_DIR = Path(__file__).parent / "static"


def create_app(
    runtime: Runtime, *, plan: Plan | None = None, max_body_bytes: int = MAX_BODY_BYTES
) -> web.Application:
    """`plan` defaults to `runtime.plan`; metrics live in a registry of this app's own."""
    state = ServerState(
        runtime=runtime,
        plan=plan if plan is not None else runtime.plan,
        metrics=ServerMetrics(),
        max_body_bytes=max_body_bytes,
        created=int(time.time()),
    )
    app = web.Application(middlewares=[openai_errors], client_max_size=max_body_bytes)
    app[STATE] = state
    app.cleanup_ctx.append(_stage_metrics)
    app.router.add_post("/v1/audio/speech", speech.create_speech)
    app.router.add_post("/v1/audio/transcriptions", transcription.create_transcription)
    app.router.add_get("/v1/models", models.list_models)
    app.router.add_get("/v1/models/{model}", models.retrieve_model)
    app.router.add_get("/health", health.health)
    app.router.add_get("/health/live", health.live)
    app.router.add_get("/health/ready", health.ready)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/", _playground)
    return app


async def _stage_metrics(app: web.Application):
    """Feed per-stage queue and compute times into this app's metrics while the app runs."""
    state = app[STATE]
    observer = state.metrics.observe_stage
    state.runtime.stage_observers.append(observer)
    yield
    state.runtime.stage_observers.remove(observer)


async def _metrics(request: web.Request) -> web.Response:
    metrics = request.app[STATE].metrics
    return web.Response(body=metrics.render(), headers={"Content-Type": metrics.content_type})


async def _playground(request: web.Request) -> web.FileResponse:
    """The browser playground page, when the clients package has put one beside this module."""
    page = STATIC_DIR / "index.html"
    if not page.is_file():
        raise ApiError(
            404, "no playground page is installed; the API is under /v1/", code="not_found"
        )
    return web.FileResponse(page)
