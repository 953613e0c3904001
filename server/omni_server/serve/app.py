"""The aiohttp application: OpenAI-compatible routes over a started `Runtime`.

The app owns no pipeline: `create_app(runtime)` adapts HTTP to `runtime.submit` and reads the
runtime's plan for models and voices. Starting and stopping the runtime is the caller's job
(`omni_server.server.serve`), so tests and embedders can run several apps in one process.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from omni_server.compiler.plan import Plan
from omni_server.serve import (
    chat,
    chat_request,
    health,
    models,
    multipart,
    openapi,
    repository_api,
    speech,
    speech_stream,
    transcription,
    voices,
)
from omni_server.serve.access import add_cors_headers, api_key, cors, host_guard
from omni_server.serve.admission import Admission
from omni_server.serve.body import body_guard
from omni_server.serve.errors import ApiError, openai_errors
from omni_server.serve.lifecycle import Lifecycle
from omni_server.serve.metrics import ServerMetrics
from omni_server.serve.options import MAX_BODY_BYTES, ServeOptions
from omni_server.serve.realtime import realtime
from omni_server.serve.state import STATE, ServerState
from omni_server.serve.voice_catalog import VoiceCatalog
from omni_server.serve.voice_store import VoiceStore

if TYPE_CHECKING:
    from omni_server.pipeline import ModelControl, Runtime

STATIC_DIR = Path(__file__).parent / "static"
SERVER_NAME = "omni-server"  # the Server header: no versions for a scanner to match


def create_app(
    runtime: Runtime | ModelControl,
    *,
    plan: Plan | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    options: ServeOptions | None = None,
) -> web.Application:
    """`plan` defaults to `runtime.plan`; metrics live in a registry of this app's own.
    `options` (the door, bounds, timeouts) default to `ServeOptions(max_body_bytes=...)`;
    with `options.data_dir` the custom voices stored there are loaded (DataDirError when the
    directory is not safe to use)."""
    if options is None:
        options = ServeOptions(max_body_bytes=max_body_bytes)
    lifecycle = Lifecycle()
    metrics = ServerMetrics()
    admission = Admission(
        options.max_in_flight,
        options.max_queued,
        options.queue_timeout_s,
        on_queue=metrics.queue_length,
    )
    store = VoiceStore(options.data_dir) if options.data_dir is not None else None
    state = ServerState(
        runtime=runtime,
        fixed_plan=plan,
        metrics=metrics,
        options=options,
        admission=admission,
        lifecycle=lifecycle,
        created=int(time.time()),
        # the plan as the state has it when asked (`state` is bound by then)
        voices=VoiceCatalog(lambda: state.plan, store),
    )
    # Outermost first: the door (host, origin), then errors as OpenAI JSON (CORS headers go on
    # those too), the key, the body's declared size and encoding, and the in-flight accounting
    # that a stop drains.
    middlewares = [host_guard, cors, openai_errors, api_key, body_guard, lifecycle.middleware]
    app = web.Application(middlewares=middlewares, client_max_size=options.max_body_bytes)
    app[STATE] = state
    app.on_response_prepare.append(_server_header)
    app.on_response_prepare.append(add_cors_headers)
    app.cleanup_ctx.append(_stage_metrics)
    app.router.add_post("/v1/audio/speech", speech.create_speech)
    app.router.add_post("/v1/audio/transcriptions", transcription.create_transcription)
    app.router.add_post("/v1/chat/completions", chat.create_chat_completion)
    app.router.add_get("/v1/realtime", realtime)
    app.router.add_get(speech_stream.PATH, speech_stream.stream_input)
    app.router.add_get(speech_stream.ELEVENLABS_PATH, speech_stream.stream_input)
    app.router.add_get("/v1/audio/voices", voices.list_voices)
    app.router.add_post("/v1/audio/voices", voices.create_voice)
    app.router.add_delete("/v1/audio/voices/{voice}", voices.delete_voice)
    state.body_limits["/v1/audio/voices"] = voices.BODY_LIMIT
    state.body_limits["/v1/chat/completions"] = chat_request.MAX_BODY_BYTES  # input_audio
    state.body_limits["/v1/audio/transcriptions"] = (
        multipart.MAX_FILE_BYTES + multipart.FORM_OVERHEAD_BYTES
    )
    app.router.add_get("/v1/models", models.list_models)
    app.router.add_get("/v1/models/{model}", models.retrieve_model)
    app.router.add_get("/health", health.health)
    app.router.add_get("/health/live", health.live)
    app.router.add_get("/health/ready", health.ready)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/", _playground)
    app.router.add_get("/openapi.json", openapi.serve_openapi)
    repository_api.add_routes(app)
    return app


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER_NAME


async def _stage_metrics(app: web.Application) -> AsyncIterator[None]:
    """Feed per-stage times and supervision events into this app's metrics while it runs."""
    state = app[STATE]
    stage, supervision = state.metrics.observe_stage, state.metrics.observe_supervision
    state.runtime.stage_observers.append(stage)
    state.runtime.supervision_observers.append(supervision)
    yield
    state.runtime.stage_observers.remove(stage)
    state.runtime.supervision_observers.remove(supervision)


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
