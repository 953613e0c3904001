"""What the app's handlers share, under one typed `web.AppKey`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from omni_server.compiler.plan import Plan
from omni_server.serve.open_sessions import OpenSessions
from omni_server.serve.options import ServeOptions

if TYPE_CHECKING:
    from omni_server.pipeline import ModelControl, Runtime
    from omni_server.serve.admission import Admission
    from omni_server.serve.lifecycle import Lifecycle
    from omni_server.serve.metrics import ServerMetrics
    from omni_server.serve.voice_catalog import VoiceCatalog


@dataclass(frozen=True)
class ServerState:
    # a Runtime (one fixed plan) or ModelControl (models loaded and swapped while serving)
    runtime: Runtime | ModelControl
    fixed_plan: Plan | None  # a plan given to create_app; None: the runtime's, as it is now
    metrics: ServerMetrics
    options: ServeOptions
    admission: Admission  # per-model places in the pipeline and the queue for them
    lifecycle: Lifecycle  # in-flight API requests; whether the server is stopping
    created: int  # unix time the app was built: the `created` of every /v1/models entry
    voices: VoiceCatalog  # every model's voices, declared and custom (serve/voice_catalog.py)
    # request path -> its own body limit, for routes that read more than `max_body_bytes`
    # (uploads); the Content-Length check (body.py) uses it
    body_limits: dict[str, int] = field(default_factory=dict)
    # the realtime sessions open now (bounded by options.max_realtime_sessions)
    realtime_sessions: OpenSessions = field(default_factory=OpenSessions)
    # the speech input streams open now (bounded by options.max_speech_stream_sessions)
    speech_streams: OpenSessions = field(default_factory=OpenSessions)

    @property
    def plan(self) -> Plan:
        """The served models now: under model control this changes with every load."""
        return self.fixed_plan if self.fixed_plan is not None else self.runtime.plan

    @property
    def max_body_bytes(self) -> int:  # aiohttp's client_max_size; bigger bodies get 413
        return self.options.max_body_bytes


STATE = web.AppKey("state", ServerState)
