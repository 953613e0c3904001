"""The door: who may call the API, from which page, under which host name.

Three middlewares, outermost first (app.py installs them in this order):

  host_guard   bound to loopback, a request must name the server by a loopback name in `Host`:
               a page whose DNS name was rebound to 127.0.0.1 sends its own name and is refused
  cors         no CORS header unless `--allowed-origins` says so; then preflights are answered
               and allowed origins get `Access-Control-Allow-Origin`. A request that carries an
               `Origin` which is neither the server's own nor allowed is refused: browsers send
               cross-origin "simple" POSTs without a preflight, so ignoring CORS is not enough
  api_key      with `--api-key`, every route except the open ones needs `Authorization: Bearer`
               with that key (or ElevenLabs' `xi-api-key` header, which their SDK sends),
               compared in constant time

Every refusal is OpenAI's error JSON; none echoes what the client sent.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress

from aiohttp import hdrs, web

from omni_server.serve.errors import Handler, error_response
from omni_server.serve.state import STATE

# Open without a key: probes (load balancers and orchestrators hold no key), the playground page
# (static; its API calls carry the key), and the API's description.
OPEN_PATHS = frozenset({"/health/live", "/health/ready", "/", "/openapi.json"})
METRICS_PATH = "/metrics"
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# Response headers a browser page may read (the speech endpoint's own, and Retry-After of a 429)
EXPOSED_HEADERS = "X-Request-Id, X-Sample-Rate, X-Channels, X-Bit-Depth, Retry-After"
PREFLIGHT_MAX_AGE_S = 600
# Browsers cannot set Authorization on a WebSocket; OpenAI's realtime API takes the key as a
# subprotocol instead, and so do we.
WS_KEY_PROTOCOL = "openai-insecure-api-key."
ELEVENLABS_KEY_HEADER = "xi-api-key"  # ElevenLabs' SDK sends the key in this header
CORS_ORIGIN = web.RequestKey("omni_cors_origin", str)  # set on requests from allowed origins


def loopback_hosts(bind_host: str) -> frozenset[str] | None:
    """The Host names to accept when serving on `bind_host`; None (any) unless it is loopback."""
    name = bind_host.strip("[]").lower()
    if name != "localhost":
        try:
            if not ipaddress.ip_address(name).is_loopback:
                return None
        except ValueError:
            return None  # a DNS name: the operator chose it, we cannot tell what it resolves to
    return LOOPBACK_NAMES | {name}


def host_name(host: str) -> str:
    """`Host` without its port, lower case, brackets off an IPv6 literal, no trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):
        name = host[1 : host.find("]")] if "]" in host else host[1:]
    elif host.count(":") > 1:  # a bare IPv6 literal (invalid in Host, but unambiguous)
        name = host
    else:
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit():
            name = host
    return name.rstrip(".")


@web.middleware
async def host_guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    allowed = request.app[STATE].options.allowed_hosts
    host = request.headers.get(hdrs.HOST)
    if allowed is not None and host is not None and host_name(host) not in allowed:
        request.app[STATE].metrics.rejected("host_not_allowed")
        return error_response(
            403,
            "this server answers only to its loopback names (localhost, 127.0.0.1, [::1]) in "
            "the Host header; requests for another name are refused (DNS rebinding)",
            code="host_not_allowed",
        )
    return await handler(request)


@web.middleware
async def cors(request: web.Request, handler: Handler) -> web.StreamResponse:
    origin = request.headers.get(hdrs.ORIGIN)
    if origin is None:
        return await handler(request)
    allowed = request.app[STATE].options.allowed_origins
    cross = _is_cross_origin(request, origin)
    if cross and "*" not in allowed and origin not in allowed:
        request.app[STATE].metrics.rejected("origin_not_allowed")
        return error_response(
            403,
            "requests from other web origins are refused; the server's --allowed-origins "
            "lists the origins it accepts",
            code="origin_not_allowed",
        )
    if not cross:
        return await handler(request)
    preflight = hdrs.ACCESS_CONTROL_REQUEST_METHOD in request.headers
    if request.method == hdrs.METH_OPTIONS and preflight:
        return await _preflight(request)
    request[CORS_ORIGIN] = origin  # every response to it, streams and errors too, gets headers
    return await handler(request)


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """An `on_response_prepare` hook: the headers go out with whatever response is sent."""
    origin = request.get(CORS_ORIGIN)
    if origin is not None:
        response.headers.update(_cors_headers(origin))


def _is_cross_origin(request: web.Request, origin: str) -> bool:
    return origin.lower() != f"{request.scheme}://{request.host}".lower()


def _cors_headers(origin: str) -> dict[str, str]:
    return {
        hdrs.ACCESS_CONTROL_ALLOW_ORIGIN: origin,
        hdrs.ACCESS_CONTROL_EXPOSE_HEADERS: EXPOSED_HEADERS,
        hdrs.VARY: hdrs.ORIGIN,
    }


async def _preflight(request: web.Request) -> web.Response:
    """Answer a CORS preflight for an allowed origin: the method, if the path serves it."""
    method = request.headers[hdrs.ACCESS_CONTROL_REQUEST_METHOD].upper()
    match = await request.app.router.resolve(request.clone(method=method))
    if match.http_exception is not None:
        return error_response(
            match.http_exception.status,
            f"{request.path} does not serve {method}"
            if match.http_exception.status == 405
            else f"no route for {request.path}",
            code="method_not_allowed" if match.http_exception.status == 405 else "not_found",
        )
    origin = request.headers[hdrs.ORIGIN]
    headers = _cors_headers(origin)
    headers[hdrs.ACCESS_CONTROL_ALLOW_METHODS] = method
    headers[hdrs.ACCESS_CONTROL_MAX_AGE] = str(PREFLIGHT_MAX_AGE_S)
    requested = request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_HEADERS)
    if requested:
        # the origin is trusted by the operator; its client library's headers (the openai
        # package sends several x-stainless-*) are allowed as asked
        headers[hdrs.ACCESS_CONTROL_ALLOW_HEADERS] = requested
    return web.Response(status=204, headers=headers)


@web.middleware
async def api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
    options = request.app[STATE].options
    if options.api_key is None or _is_open(request.path, options.metrics_need_key):
        return await handler(request)
    presented = _presented_key(request)
    if presented is None:
        message = (
            "no API key: send it as 'Authorization: Bearer <key>' (the key the server was "
            "started with, --api-key or OMNI_SERVER_API_KEY)"
        )
    elif not _same_key(presented, options.api_key):
        message = "the API key is not valid for this server"
    else:
        return await handler(request)
    request.app[STATE].metrics.rejected("unauthorized")
    return error_response(
        401, message, code="invalid_api_key", headers={hdrs.WWW_AUTHENTICATE: "Bearer"}
    )


def _is_open(path: str, metrics_need_key: bool) -> bool:
    return path in OPEN_PATHS or (path == METRICS_PATH and not metrics_need_key)


def _presented_key(request: web.Request) -> str | None:
    scheme, _, key = request.headers.get(hdrs.AUTHORIZATION, "").partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return key.strip()
    if request.headers.get(ELEVENLABS_KEY_HEADER, "").strip():
        return request.headers[ELEVENLABS_KEY_HEADER].strip()
    for protocol in request.headers.get(hdrs.SEC_WEBSOCKET_PROTOCOL, "").split(","):
        protocol = protocol.strip()
        if protocol.startswith(WS_KEY_PROTOCOL):
            return protocol[len(WS_KEY_PROTOCOL) :]
    return None


def _same_key(presented: str, expected: str) -> bool:
    """Constant time in the keys' contents and lengths: both are hashed to 32 bytes first."""
    a = hashlib.sha256(presented.encode("utf-8", "surrogatepass")).digest()
    b = hashlib.sha256(expected.encode("utf-8", "surrogatepass")).digest()
    return hmac.compare_digest(a, b)
