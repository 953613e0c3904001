"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

Handlers raise `ApiError`; the `openai_errors` middleware turns it, and aiohttp's own HTTP
errors (404 unknown route, 405 wrong method, 413 oversize body), into that JSON so every client
of the OpenAI API sees the shape it parses.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from aiohttp import web

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
# Every 503 says when to come back: a stage process that died is restarted in seconds (a warm
# restart of the thinker ~8 s, docs/runtime.md), a starting server is ready in about as long.
UNAVAILABLE_RETRY_AFTER_S = 5

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]  # what a middleware wraps


class ApiError(Exception):
    """A request that gets an error response instead of its result."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or (SERVER_ERROR if status >= 500 else INVALID_REQUEST)
        self.headers = headers

    def response(self) -> web.Response:
        return error_response(
            self.status,
            self.message,
            param=self.param,
            code=self.code,
            type=self.type,
            headers=self.headers,
        )


def invalid_field(param: str, message: str, code: str = "invalid_value") -> ApiError:
    """400 for one request field; the message and `param` both name it."""
    return ApiError(400, message, param=param, code=code)


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    type: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    error = {
        "message": message,
        "type": type or (SERVER_ERROR if status >= 500 else INVALID_REQUEST),
        "param": param,
        "code": code,
    }
    if status == 503 and "Retry-After" not in (headers or {}):
        headers = {**(headers or {}), "Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)}
    return web.json_response({"error": error}, status=status, headers=headers)


# aiohttp raises these itself (router, body reader); `code` is what clients can switch on.
_HTTP_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
}


# Set on a request once its streamed response has sent headers: an error can no longer be a
# JSON response, only a cut stream.
STREAM_STARTED = web.RequestKey("omni_stream_started", bool)


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as error:
        response = error.response()
        if (error.headers or {}).get("Connection") == "close":
            # the body was left unread because it is broken (or late, or too big): close
            # without aiohttp's lingering read, which would only fail on it again
            response.force_close()
        return response
    except web.HTTPException as exc:
        return _http_error(request, exc)
    except Exception:  # a bug: the client still gets OpenAI's shape, the log the traceback
        log.exception("unhandled error in %s %s", request.method, request.path)
        if request.get(STREAM_STARTED):
            if request.transport is not None:
                request.transport.close()  # never let a truncated stream look complete
            raise
        return error_response(500, "internal server error; see the server log", code="internal")


def _http_error(request: web.Request, exc: web.HTTPException) -> web.StreamResponse:
    """aiohttp's own errors (router, body reader) as OpenAI JSON."""
    if exc.status < 400:
        raise exc  # redirects and the like pass through untouched
    if exc.status == 404:
        message = f"no route for {request.method} {request.path}"
    elif exc.status == 405:
        allowed = ", ".join(sorted(getattr(exc, "allowed_methods", ()) or ()))
        message = f"{request.method} is not allowed on {request.path} (allowed: {allowed})"
    elif exc.status == 413:
        # the limit aiohttp's body reader enforced: the app's `client_max_size` (ServeOptions'
        # max_body_bytes), read off the request so this module needs nothing of the app's state
        limit = request.client_max_size
        message = f"request body is larger than the server's limit of {limit} bytes"
    else:
        message = exc.text or HTTPStatus(exc.status).phrase
    headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
    return error_response(exc.status, message, code=_HTTP_CODES.get(exc.status), headers=headers)
