"""Health probes: `/health/live` (the HTTP server answers), `/health/ready` (requests can be
served), `/health` (both, with the detail an operator reads). Not ready or unhealthy is a 503
with OpenAI's error JSON, so load balancers and humans read the same answer."""

from __future__ import annotations

from aiohttp import web

from omni_server.serve.errors import UNAVAILABLE_RETRY_AFTER_S, error_response
from omni_server.serve.state import STATE


async def live(request: web.Request) -> web.Response:
    return web.json_response({"status": "live"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    runtime = state.runtime
    if state.lifecycle.stopping:  # draining: send new requests elsewhere
        return error_response(503, "the server is shutting down", code="not_ready")
    if not runtime.ready:
        return error_response(503, "the pipeline is not ready", code="not_ready")
    if not runtime.healthy:
        return error_response(503, "the pipeline is unhealthy", code="unavailable")
    return web.json_response({"status": "ready"})


async def health(request: web.Request) -> web.Response:
    """`ready`: the runtime has started; `healthy`: ready and every process has a live replica
    ("degraded", still 200, while a replica restarts or has failed: `detail` says which)."""
    state = request.app[STATE]
    is_ready = bool(state.runtime.ready) and not state.lifecycle.stopping
    healthy = is_ready and bool(state.runtime.healthy)
    runtime_status, detail = state.runtime.health()
    status: str = runtime_status if healthy else ("unhealthy" if is_ready else "not_ready")
    if state.lifecycle.stopping:
        status = "stopping"
    body = {
        "status": status,
        "ready": is_ready,
        "healthy": healthy,
        "detail": detail,
        "models": list(state.plan.models),
    }
    if healthy:
        return web.json_response(body)
    return web.json_response(
        body, status=503, headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)}
    )
