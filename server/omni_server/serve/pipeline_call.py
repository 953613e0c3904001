"""The one way a served request enters the pipeline, for every endpoint and the realtime session.

    respond(request, endpoint, answer)       HTTP only: the request's metrics track, and what an
                                             early end counts as (its client left: 499; the
                                             server stopping: 503)
      admitted(state, model)                 503 unless the model can be served, then one of
                                             its admission places (429 when none comes), shown
                                             in the in-pipeline gauge while it is held
        submitted(state, model, inputs)      `Runtime.submit`; leaving the block, for any
                                             reason, aborts the request in every stage

`ApiCall.pipeline(model, inputs)` is `admitted` + `submitted` for an HTTP endpoint (inside
`respond`, which hands the endpoint its `ApiCall`); chat's audio
parts (several transcriptions under one place) and the realtime session (its responses and its
turns' transcriptions) use `admitted` and `submitted` themselves. `pipeline_error` and
`request_error` turn a `PipelineError` into the client's `ApiError`.

Invariant: the in-pipeline gauge (`omni_requests_in_flight{model}`) counts exactly the
admission places held, so `/metrics` shows what admission bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from omni_server.compiler.plan import ModelSpec
from omni_server.errors import OUT_OF_GPU_MEMORY
from omni_server.pipeline import ModelControl, PipelineError, RequestHandle, Runtime
from omni_server.serve.admission import RATE_LIMITED, RateLimited
from omni_server.serve.body import ClientGone
from omni_server.serve.errors import ApiError
from omni_server.serve.metrics import RequestTrack
from omni_server.serve.state import STATE, ServerState

log = logging.getLogger(__name__)

CLIENT_GONE = 499  # status recorded (never sent) when the client left before the end
NOT_SUBMITTED = "(not yet submitted)"  # the request id an early end logs before submit


class ContractError(PipelineError):
    """The pipeline's output broke its endpoint's contract (a chunk or result of the wrong
    shape): checked by the endpoint, so the message is ours, not a library's, and the client
    may read it."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="stage_failed")


def require_ready(runtime: Runtime | ModelControl, model: ModelSpec) -> None:
    """503 unless the runtime takes requests of `model`: started, and every process the model's
    stages use has a live replica (a process of another model being down does not matter)."""
    if not runtime.ready:
        raise ApiError(503, "the pipeline is not ready; see /health/ready", code="not_ready")
    reason = runtime.unavailable_for(model)
    if reason is not None:
        raise ApiError(503, f"{model.id} is unavailable: {reason}", code="unavailable")


@contextlib.asynccontextmanager
async def admitted(
    state: ServerState, model: ModelSpec, *, wait: bool = True
) -> AsyncIterator[None]:
    """Hold one of `model`'s admission places for the block, counted in the in-pipeline gauge.

    Raises ApiError 503 when the model cannot be served and RateLimited (429) when no place
    comes: after the queue (`wait`) or at once (`wait=False`, see `Admission.place`)."""
    require_ready(state.runtime, model)
    async with state.admission.place(model.id, wait=wait):
        with state.metrics.in_pipeline(model.id):
            yield


@contextlib.asynccontextmanager
async def submitted(
    state: ServerState,
    model: ModelSpec,
    inputs: dict[str, Any],
    request_id: str | None = None,
    *,
    errors: Callable[[PipelineError], ApiError] | None = None,
) -> AsyncIterator[RequestHandle]:
    """Submit one request of `model` (inside `admitted`). A submit the runtime refuses raises
    its PipelineError, or `errors(exc)` when given; so does a request in a custom voice deleted
    since it named it (`invalid_request`, `voice_not_found`: a 400). The custom voice's clip is
    held until the request ends (`VoiceCatalog.held_for`). Leaving the block before the request
    finished (a client gone, a failure, a cancel, server shutdown) aborts it in every stage."""
    with contextlib.ExitStack() as voice:
        try:
            voice.enter_context(state.voices.held_for(inputs))
            handle = state.runtime.submit(model, inputs, request_id)
        except PipelineError as exc:
            if errors is None:
                raise
            raise errors(exc) from exc
        async with handle:
            yield handle


def pipeline_error(exc: PipelineError, request_id: str | None = None) -> ApiError:
    """503 when the pipeline cannot take requests at all, 504 when a stage ran past its time,
    else 500. The message names the stage but not the exception's text: that comes from
    libraries inside the stage (paths, shapes, versions) and goes to the server log, which the
    request id finds."""
    if exc.code == "unavailable":
        return ApiError(503, exc.message, code="unavailable")
    if isinstance(exc, ContractError):
        return ApiError(500, exc.message, code="pipeline_error")
    where = f"stage '{exc.stage}'" if exc.stage else "the pipeline"
    see_log = f"; the server log has the details (request {request_id})" if request_id else ""
    if exc.code == "timeout":
        return ApiError(504, f"{where} did not finish in time{see_log}", code="timeout")
    if exc.code == "process_died":
        return ApiError(500, f"the process running {where} died{see_log}", code="pipeline_error")
    if exc.error_code == OUT_OF_GPU_MEMORY:  # the request failed; the stage serves on
        return ApiError(500, f"{where} ran out of GPU memory{see_log}", code="pipeline_error")
    return ApiError(500, f"{where} failed{see_log}", code="pipeline_error")


def request_error(exc: PipelineError, request_id: str | None = None) -> ApiError:
    """As `pipeline_error`, except that a stage's refusal of the input (`InvalidRequest`) is the
    client's fault: 400 with the stage's message, OpenAI `code` and `param`; a refusal with
    code `rate_limit_exceeded` (the stage holds all the work it allows now, e.g. the ASR's
    decoded audio) is OpenAI's 429 with `Retry-After`, as admission's."""
    if exc.code == "invalid_request" and exc.error_code == RATE_LIMITED:
        return RateLimited(exc.message)
    if exc.code == "invalid_request":
        return ApiError(400, exc.message, param=exc.param, code=exc.error_code or "invalid_value")
    return pipeline_error(exc, request_id)


class ApiCall:
    """One HTTP API request on its way through the pipeline: its metrics track, and the id the
    runtime gave it (what the log line of an early end names)."""

    def __init__(self, request: web.Request, endpoint: str, track: RequestTrack) -> None:
        self.request, self.endpoint, self.track = request, endpoint, track
        self.state = request.app[STATE]
        self.request_id = NOT_SUBMITTED

    @contextlib.asynccontextmanager
    async def pipeline(
        self,
        model: ModelSpec,
        inputs: dict[str, Any],
        *,
        request_id: str | None = None,
        errors: Callable[[PipelineError], ApiError] = request_error,
    ) -> AsyncIterator[RequestHandle]:
        """`admitted` + `submitted`: a submit the runtime refuses is `errors(exc)`, an
        ApiError. A failure of the running request is the endpoint's to map: it may already be
        streaming."""
        async with (
            admitted(self.state, model),
            submitted(self.state, model, inputs, request_id, errors=errors) as handle,
        ):
            self.request_id = handle.id
            yield handle

    def ended_early(self) -> None:
        """Account a request that ended before its answer did: the server is stopping (its
        drain cancelled the handler), or its client left."""
        what = f"{self.endpoint} request {self.request_id} aborted"
        if self.state.lifecycle.stopping:
            self.track.fail(503, "server_shutdown")
            log.info("%s: the server is shutting down", what)
        else:
            self.track.fail(CLIENT_GONE, "client_disconnected")
            log.info("%s: client disconnected", what)


async def respond(
    request: web.Request, endpoint: str, answer: Callable[[ApiCall], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Run one API request's `answer` under its metrics track (`omni_requests_total{endpoint}`).

    aiohttp cancels the handler when the client disconnects (handler_cancellation), a stop
    cancels what outlives the grace period, and a write racing a disconnect raises; each is
    logged and counted once, here, and the request's handle (if any) has aborted it in every
    stage on the way out."""
    with request.app[STATE].metrics.track(endpoint) as track:
        call = ApiCall(request, endpoint, track)
        try:
            return await answer(call)
        except asyncio.CancelledError:
            call.ended_early()
            raise
        except (ConnectionResetError, ClientGone):
            call.ended_early()
            return web.Response(status=CLIENT_GONE)  # nobody is left to read it
