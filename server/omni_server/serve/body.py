"""Request bodies: bounded in size, time and shape before any endpoint parses them.

- `body_guard` (middleware): a declared `Content-Length` over the limit is a 413 at once, before
  a byte of the body is read; a `Content-Encoding` other than identity, gzip or deflate is a 415
  (aiohttp would otherwise hand the still-encoded bytes over as if they were plain).
- `read_body`: the whole body within `body_timeout_s` (408 after) and within its route's limit
  (`body_limit`: 413 as soon as the decoded bytes cross it, so a gzip bomb stops there too), a
  body that does not decode as its `Content-Encoding` says is a 400, a client that leaves
  mid-upload is `ClientGone`.
- `read_json`: the body as a JSON value; a body not sent as JSON (`Content-Type` other than
  `application/json` or `*/*+json`: a form, `text/plain`, none) is a 415 before it is read;
  invalid JSON, or JSON nested deeper than Python's parser recurses, is a 400 `invalid_json`;
  a string no codec can carry (a lone UTF-16 surrogate), a 400 `invalid_value` naming its place.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import hdrs, web
from aiohttp.web_protocol import RequestPayloadError

from omni_server.serve.errors import ApiError, Handler, error_response
from omni_server.serve.state import STATE
from omni_server.serve.validation import check_json_text

DECODED_ENCODINGS = frozenset({"identity", "gzip", "x-gzip", "deflate"})
JSON_MEDIA = "application/json"


class ClientGone(Exception):
    """The client closed the connection before its request body was complete."""


@web.middleware
async def body_guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    limit = body_limit(request)
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


def body_limit(request: web.Request) -> int:
    """The most bytes `request`'s route reads: its own limit (chat's input audio, uploads), else
    the server's `max_body_bytes`."""
    state = request.app[STATE]
    return state.body_limits.get(request.path, state.max_body_bytes)


async def read_body(request: web.Request) -> bytes:
    """The whole body, within the route's limit and the body timeout (module docstring)."""
    timeout = request.app[STATE].options.body_timeout_s
    try:
        async with asyncio.timeout(timeout):
            return await _read_within(request, body_limit(request))
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
            headers={hdrs.CONNECTION: "close"},
        ) from None


async def _read_within(request: web.Request, limit: int) -> bytes:
    """The body as it arrives, decoded; not `request.read()`, whose one limit is the app's
    `client_max_size` whatever the route."""
    body = bytearray()
    async for chunk in request.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise ApiError(
                413,
                f"the request body is larger than this route's limit of {limit} bytes",
                code="request_too_large",
                headers={hdrs.CONNECTION: "close"},  # the rest of the body is never read
            )
    return bytes(body)


async def read_json(request: web.Request) -> Any:
    require_json(request)
    return parse_json(await read_body(request))


def require_json(request: web.Request) -> None:
    """415 for a body not declared as JSON: a JSON API takes JSON only (a form or text/plain
    would otherwise be parsed as if it were)."""
    media = request.content_type  # aiohttp: application/octet-stream when none was sent
    if media == JSON_MEDIA or (media.startswith("application/") and media.endswith("+json")):
        return
    sent = request.headers.get(hdrs.CONTENT_TYPE)
    raise ApiError(
        415,
        "the request body must be JSON sent with 'Content-Type: application/json' "
        f"(got {'no Content-Type' if sent is None else repr(media)})",
        code="unsupported_media_type",
    )


def parse_json(raw: bytes) -> Any:
    try:
        value = json.loads(raw)
    except RecursionError:
        message = "the request body is JSON nested too deeply"
    except UnicodeDecodeError:
        message = "the request body is not UTF-8 text"
    except ValueError as exc:  # JSONDecodeError: the position, never the text
        message = f"the request body is not valid JSON: {exc}"
    else:
        check_json_text(value)  # a lone surrogate anywhere: 400 naming its place
        return value
    raise ApiError(400, message, code="invalid_json")
