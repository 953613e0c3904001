"""The replica's ASGI app: every HTTP request and WebSocket that Serve's proxy hands the
replica goes, unchanged, to the replica's private aiohttp server (private_server.py).

There is no second API here. Status, headers and body bytes come back as the server wrote
them, chunk by chunk as they arrive (a streamed speech response's first bytes leave as soon as
the voice makes them); the door (key, origin, host), the bounds and OpenAI's error JSON are the
server's own. Not copied: hop-by-hop headers, which describe one connection, and `Date` and
`Server`, which the proxy's HTTP server writes itself. Added: `X-Omni-Replica` and
`X-Omni-Node`, the replica that answered and its Ray node. A response cut by the server (a
stream whose pipeline failed) is cut here too: the exception ends the ASGI response without
its final chunk, which the proxy passes on as a broken stream.

A WebSocket (`/v1/realtime`) is a second WebSocket to the private server, opened with the
client's headers and offered subprotocols, then pumped both ways until either side closes; the
session stays on this replica for its whole life (Serve routes a WebSocket once).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import aiohttp
from aiohttp import WSMsgType

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

REPLICA_HEADER = b"x-omni-replica"  # the Serve replica that answered
NODE_HEADER = b"x-omni-node"  # the Ray node it runs on
# RFC 9110 7.6.1: headers of one connection, never forwarded by a proxy
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# the WebSocket handshake's own headers: the second handshake makes its own
HANDSHAKE = frozenset(
    {
        b"sec-websocket-key",
        b"sec-websocket-version",
        b"sec-websocket-extensions",
        b"sec-websocket-protocol",
        b"sec-websocket-accept",
    }
)
OWN_HEADERS = frozenset({b"date", b"server", REPLICA_HEADER, NODE_HEADER})
WS_MAX_MESSAGE_BYTES = 16 << 20  # the server bounds what clients send; this bounds its own
POLICY_VIOLATION = 1008


class Forwarder:
    """An ASGI app forwarding to the aiohttp server on `socket_path` (set before the first
    request, by the replica once its server listens)."""

    def __init__(self, replica_id: str, node_id: str) -> None:
        self.added = [(REPLICA_HEADER, replica_id.encode()), (NODE_HEADER, node_id.encode())]
        self.socket_path: str | None = None
        self._session: aiohttp.ClientSession | None = None

    def open(self, socket_path: str) -> None:
        """Start forwarding to `socket_path`; call on the loop that serves the requests."""
        self.socket_path = socket_path
        # no total timeout: a long stream is bounded by the server's own write timeouts
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=socket_path, limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,  # bytes as the server wrote them (Content-Encoding kept)
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
        elif scope["type"] == "lifespan":  # nothing to start: the replica owns the server
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})

    def _session_or_raise(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the replica's server is not listening yet")
        return self._session

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        session = self._session_or_raise()
        headers = _forwarded_headers(scope["headers"], HOP_BY_HOP)
        has_body = any(k.lower() in ("content-length", "transfer-encoding") for k, _ in headers)
        async with session.request(
            scope["method"],
            _target(scope),
            headers=headers,
            data=_request_body(receive) if has_body else None,
            allow_redirects=False,
            compress=None,
        ) as upstream:
            # Date and Server: the proxy's HTTP server writes its own (two would be sent)
            out = [
                (k.lower(), v)
                for k, v in upstream.raw_headers
                if k.lower() not in HOP_BY_HOP | OWN_HEADERS
            ]
            out.extend(self.added)
            await send({"type": "http.response.start", "status": upstream.status, "headers": out})
            # iter_any: each chunk as it arrives, never waiting to fill a buffer; a stream the
            # server cut raises ClientPayloadError here, which cuts this response too
            async for chunk in upstream.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        session = self._session_or_raise()
        if (await receive())["type"] != "websocket.connect":
            return
        headers = _forwarded_headers(scope["headers"], HOP_BY_HOP | HANDSHAKE)
        try:
            upstream = await session.ws_connect(
                _target(scope),
                headers=headers,
                protocols=tuple(scope.get("subprotocols") or ()),
                autoclose=False,
                max_msg_size=WS_MAX_MESSAGE_BYTES,
            )
        except aiohttp.WSServerHandshakeError as exc:
            # the server refused the upgrade (the key, the origin, an unknown model): its
            # status goes back as the denial where the proxy supports one, else a close
            await _deny(scope, send, exc.status, exc.message)
            return
        async with upstream:
            await send(
                {
                    "type": "websocket.accept",
                    "subprotocol": upstream.protocol,
                    "headers": self.added,
                }
            )
            await _pump(receive, send, upstream)


def _target(scope: Scope) -> str:
    # the host part is ignored by the Unix connector; the Host header travels as sent
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string") or b""
    return (
        "http://replica" + path.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
    )


def _forwarded_headers(
    raw: list[tuple[bytes, bytes]], dropped: frozenset[bytes]
) -> list[tuple[str, str]]:
    connection_named = set()  # headers the client's Connection header names are hop-by-hop too
    for key, value in raw:
        if key.lower() == b"connection":
            connection_named |= {v.strip().lower().encode() for v in value.decode().split(",")}
    return [
        (k.decode("latin-1"), v.decode("latin-1"))
        for k, v in raw
        if k.lower() not in dropped and k.lower() not in connection_named
    ]


async def _request_body(receive: Receive) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError("the client left before sending its whole body")
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return


async def _deny(scope: Scope, send: Send, status: int, reason: str) -> None:
    if "websocket.http.response" in scope.get("extensions", {}):
        body = reason.encode()
        await send(
            {
                "type": "websocket.http.response.start",
                "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8")],
            }
        )
        await send({"type": "websocket.http.response.body", "body": body, "more_body": False})
    else:
        await send({"type": "websocket.close", "code": POLICY_VIOLATION, "reason": reason[:120]})


async def _pump(receive: Receive, send: Send, upstream: aiohttp.ClientWebSocketResponse) -> None:
    """Client -> server and server -> client until one side closes; then close the other."""

    async def client_to_server() -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                await upstream.close(code=message.get("code", 1000))
                return
            if message.get("text") is not None:
                await upstream.send_str(message["text"])
            elif message.get("bytes") is not None:
                await upstream.send_bytes(message["bytes"])

    async def server_to_client() -> None:
        async for message in upstream:
            if message.type == WSMsgType.TEXT:
                await send({"type": "websocket.send", "text": message.data})
            elif message.type == WSMsgType.BINARY:
                await send({"type": "websocket.send", "bytes": message.data})
            elif message.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.ERROR):
                break
        code = upstream.close_code or 1000
        with contextlib.suppress(RuntimeError, OSError):  # the client may be gone already
            await send({"type": "websocket.close", "code": code, "reason": ""})

    tasks = [asyncio.ensure_future(client_to_server()), asyncio.ensure_future(server_to_client())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
