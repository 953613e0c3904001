"""Time bounds on an HTTP connection (headers, idle), and what malformed HTTP gets back.

aiohttp's own request handler, with three changes:
- a request's header block must arrive within `header_timeout_s` of its first byte (a slowloris
  client that trickles headers is closed); a connection with no request in progress is closed
  after `idle_timeout_s` (aiohttp's keep-alive timer, which also starts at connect, so a socket
  that never says anything goes too). Body reads are bounded by the endpoints (`read_body`);
- HTTP the parser refuses (a bad request line, a header too long, a broken chunked encoding or
  an absurd chunk size) gets OpenAI's error JSON, which never echoes the request's bytes;
- the `Server` header names no versions.

`make_runner(app, options)` builds the `AppRunner` that serves with it (server.py, tests).
"""

from __future__ import annotations

import asyncio
import json
import logging
from http import HTTPStatus
from typing import Any

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import (
    BadHttpMessage,
    BadHttpMethod,
    BadStatusLine,
    ContentEncodingError,
    ContentLengthError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    TransferEncodingError,
)
from aiohttp.web_protocol import RequestPayloadError

from omni_server.serve.app import SERVER_NAME
from omni_server.serve.errors import INVALID_REQUEST, SERVER_ERROR
from omni_server.serve.options import ServeOptions

log = logging.getLogger(__name__)

# After a response that left the request body unread (a 413 on Content-Length, a 401), aiohttp
# reads and discards the rest for this long before closing, so the client sees the response
# rather than a reset; short, since we refused the body on purpose.
LINGER_S = 1.0
# Past this a stop cancels what is left of a connection's handler (lifecycle.drain has already
# given requests their grace period, so only idle connections remain here).
CONNECTION_SHUTDOWN_S = 1.0

_PARSE_ERRORS: tuple[tuple[type[Exception], str], ...] = (
    (BadHttpMethod, "the request method is not valid HTTP"),
    (LineTooLong, "the request line or a header is longer than the server accepts"),
    (InvalidURLError, "the request target is not a valid URL"),
    (BadStatusLine, "the request line is not valid HTTP/1.1"),
    (TransferEncodingError, "the chunked transfer encoding of the body is malformed"),
    (ContentLengthError, "the body does not match its Content-Length"),
    (InvalidHeader, "a request header is malformed"),
    (ContentEncodingError, "the Content-Encoding is not supported; gzip and deflate are"),
    (BadHttpMessage, "the request is not valid HTTP/1.1"),
)


class GuardedRequestHandler(web_protocol.RequestHandler):
    def __init__(self, *args: Any, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout = header_timeout
        self._header_deadline: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        waiting = self._waiter is not None and not self._waiter.done()
        if waiting and self._header_deadline is None and data:
            count = self._request_count
            self._header_deadline = self._loop.call_later(
                self._header_timeout, self._headers_overdue, count
            )
        counted = self._request_count
        super().data_received(data)
        if self._request_count != counted and self._header_deadline is not None:
            self._header_deadline.cancel()  # a whole request arrived in time
            self._header_deadline = None

    def _headers_overdue(self, count: int) -> None:
        self._header_deadline = None
        if self._request_count == count and self._waiter is not None and not self._waiter.done():
            log.debug("closing a connection whose request headers took too long")
            self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None
        super().connection_lost(exc)

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        """A body the client broke (bad gzip, cut chunked framing) surfacing after its
        response, in aiohttp's read of the rest: the client's mistake, logged without a
        traceback; everything else as aiohttp logs it."""
        exc = kwargs.get("exc_info")
        if isinstance(exc, RequestPayloadError | BadHttpMessage):
            self.logger.debug("a request body was malformed: %s", type(exc).__name__)
            return
        super().log_exception(*args, **kwargs)

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's last resort (parser errors, a handler that escaped every middleware) as
        OpenAI's JSON. `message` (aiohttp's text, which quotes the offending bytes) is dropped."""
        if status >= 500:
            self.log_exception("error handling a request", exc_info=exc)
        else:
            self.logger.debug("malformed request: %s", type(exc).__name__)
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already sent; the connection is closed")
        body = {
            "error": {
                "message": describe_http_error(status, exc),
                "type": SERVER_ERROR if status >= 500 else INVALID_REQUEST,
                "param": None,
                "code": "invalid_http" if status < 500 else "internal",
            }
        }
        response = web.Response(
            status=status,
            body=json.dumps(body).encode(),
            content_type="application/json",
            headers={"Server": SERVER_NAME},
        )
        response.force_close()
        return response


def describe_http_error(status: int, exc: BaseException | None) -> str:
    if status >= 500:
        if status == 504:
            return "the request timed out"
        return "internal server error; see the server log"
    for kind, text in _PARSE_ERRORS:
        if isinstance(exc, kind):
            return text
    return f"malformed HTTP request ({HTTPStatus(status).phrase})"


class _GuardedServer(web.Server):
    """aiohttp's Server, making a GuardedRequestHandler per connection."""

    def __init__(self, *args: Any, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout = header_timeout

    def __call__(self) -> web_protocol.RequestHandler:
        return GuardedRequestHandler(
            self, loop=self._loop, header_timeout=self._header_timeout, **self._kwargs
        )


class GuardedRunner(web.AppRunner):
    """An AppRunner whose connections are GuardedRequestHandlers."""

    def __init__(self, app: web.Application, *, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout = header_timeout

    async def _make_server(self) -> web.Server:
        # what AppRunner._make_server and Application._make_handler do, with our Server class
        app = self.app
        loop = asyncio.get_running_loop()
        app._set_loop(loop)
        app.on_startup.freeze()
        await app.startup()
        app.freeze()
        return _GuardedServer(
            app._handle,
            request_factory=app._make_request,
            loop=loop,
            header_timeout=self._header_timeout,
            debug=False,
            **self._kwargs,
        )


def make_runner(app: web.Application, options: ServeOptions) -> GuardedRunner:
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its
    # request in every stage instead of computing audio nobody will read.
    return GuardedRunner(
        app,
        header_timeout=options.header_timeout_s,
        handler_cancellation=True,
        shutdown_timeout=CONNECTION_SHUTDOWN_S,
        keepalive_timeout=options.idle_timeout_s,
        lingering_time=LINGER_S,
        access_log=None,
    )
