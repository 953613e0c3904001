"""What the app's handlers share, under one typed `web.AppKey`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from omni_server.repository.plan import Plan

if TYPE_CHECKING:
    from omni_server.runtime import Runtime
    from omni_server.serve.metrics import ServerMetrics


@dataclass(frozen=True)
class ServerState:
    runtime: Runtime
    plan: Plan
    metrics: ServerMetrics
    max_body_bytes: int  # aiohttp's client_max_size; bigger bodies get 413
    created: int  # unix time the app was built: the `created` of every /v1/models entry


STATE = web.AppKey("state", ServerState)
