"""Request bodies: bounded in size, time and shape before any endpoint parses them.

- `body_guard` (middleware): a declared `Content-Length` over the limit is a 413 at once, before
  a byte of the body is read; a `Content-Encoding` other than identity, gzip or deflate is a 415
  (aiohttp would otherwise hand the still-encoded bytes over as if they were plain).
- `read_body`: the whole body within `body_timeout_s` (408 after), a body that does not decode
  as its `Content-Encoding` says is a 400, a client that leaves mid-upload is `ClientGone`.
- `read_json`: the body as a JSON value; invalid JSON, or JSON nested deeper than Python's
  parser recurses, is a 400 `invalid_json`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import hdrs, web
from aiohttp.web_protocol import RequestPayloadError

from omni_server.serve.errors import ApiError, Handler, error_response
from omni_server.serve.state import STATE

DECODED_ENCODINGS = frozenset({"identity", "gzip", "x-gzip", "deflate"})


class ClientGone(Exception):
    """The client closed the connection before its request body was complete."""


@web.middleware
async def body_guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    limit = state.body_limits.get(request.path, state.max_body_bytes)
    declared = request.content_length
    if declared is not None and declared > limit:
        response = error_response(
            413,
            f"the request body ({declared} bytes) is larger than the server's limit of "
            f"{limit} bytes",
            code="request_too_large",
        )
        response.force_close()  # the unread body must not be taken for the next request
        return response
    encoding = request.headers.get(hdrs.CONTENT_ENCODING, "identity").strip().lower()
    if encoding not in DECODED_ENCODINGS:
        return error_response(
            415,
            "the request's Content-Encoding is not supported; send the body as is, or gzip "
            "or deflate it",
            code="unsupported_content_encoding",
        )
    return await handler(request)


async def read_body(request: web.Request) -> bytes:
    """The whole body; bodies over client_max_size raise aiohttp's 413 (errors.py words it)."""
    timeout = request.app[STATE].options.body_timeout_s
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {timeout:g} s",
            code="request_timeout",
            headers={hdrs.CONNECTION: "close"},
        ) from None
    except RequestPayloadError as exc:
        if request.transport is None or request.transport.is_closing():
            raise ClientGone() from exc
        encoding = request.headers.get(hdrs.CONTENT_ENCODING, "identity")
        raise ApiError(
            400,
            f"the request body is not valid {encoding.strip().lower()} data, or its length "
            "or chunked framing is broken",
            code="invalid_body",
        ) from None


async def read_json(request: web.Request) -> Any:
    return parse_json(await read_body(request))


def parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        message = "the request body is JSON nested too deeply"
    except UnicodeDecodeError:
        message = "the request body is not UTF-8 text"
    except ValueError as exc:  # JSONDecodeError: the position, never the text
        message = f"the request body is not valid JSON: {exc}"
    raise ApiError(400, message, code="invalid_json")
