"""The replica's forwarder alone, without Ray: an ASGI server (uvicorn, the server Serve's
proxy runs) in front of `Forwarder`, in front of a real aiohttp app on a Unix socket. What
goes through must come back as the app wrote it: status, headers, error bodies, each chunk
when it is written, a cut stream cut, WebSocket messages and subprotocols, a refused upgrade
refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

uvicorn = pytest.importorskip("uvicorn")

from omni_server.cluster.forward import Forwarder  # noqa: E402


class Backend:
    def __init__(self) -> None:
        self.first_chunk_seen = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_post("/echo", self.echo)
        self.app.router.add_get("/stream", self.stream)
        self.app.router.add_get("/cut", self.cut)
        self.app.router.add_get("/ws", self.ws)

    async def echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        if not body:
            return web.json_response(
                {"error": {"message": "empty", "type": "invalid_request_error", "param": None,
                           "code": None}},
                status=400,
            )  # fmt: skip
        headers = {"X-Thing": request.headers.get("X-Thing", ""), "X-Host": request.host}
        return web.Response(body=body[::-1], status=201, headers=headers)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"first")
        # the second chunk waits until the client has the first: a forwarder that buffered
        # the body would never deliver it, and the test would time out here
        await asyncio.wait_for(self.first_chunk_seen.wait(), 30)
        await response.write(b"second")
        await response.write_eof()
        return response

    async def cut(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"partial")
        raise RuntimeError("the pipeline failed mid-stream")  # aiohttp drops the connection

    async def ws(self, request: web.Request) -> web.WebSocketResponse:
        if request.headers.get("Authorization") != "Bearer k":
            raise web.HTTPUnauthorized()
        ws = web.WebSocketResponse(protocols=("realtime",))
        await ws.prepare(request)
        async for message in ws:
            if message.type == aiohttp.WSMsgType.TEXT:
                await ws.send_str(message.data.upper())
            elif message.type == aiohttp.WSMsgType.BINARY:
                await ws.send_bytes(message.data[::-1])
        return ws


@pytest.fixture
async def proxied(tmp_path: Path) -> AsyncIterator[tuple[str, Backend]]:
    backend = Backend()
    runner = web.AppRunner(backend.app)
    await runner.setup()
    socket_path = tmp_path / "http.sock"
    await web.UnixSite(runner, str(socket_path)).start()
    forwarder = Forwarder("replica-1", "node-1")
    forwarder.open(str(socket_path))
    server = uvicorn.Server(
        uvicorn.Config(forwarder, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    )
    serving = asyncio.ensure_future(server.serve())
    while not server.started:
        assert not serving.done(), serving
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", backend
    finally:
        server.should_exit = True
        await serving
        await forwarder.close()
        await runner.cleanup()


async def test_status_headers_and_body_come_back_as_written(proxied) -> None:
    url, _ = proxied
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/echo", data=b"abc", headers={"X-Thing": "7"}) as r:
            assert r.status == 201 and await r.read() == b"cba"
            assert r.headers["X-Thing"] == "7" and r.headers["X-Host"] == f"{url[7:]}"
            assert r.headers["X-Omni-Replica"] == "replica-1"
            assert r.headers["X-Omni-Node"] == "node-1"
            assert r.headers.getall("Server") == ["uvicorn"]  # one, the front server's
        async with http.post(f"{url}/echo", data=b"") as r:
            assert r.status == 400
            assert (await r.json())["error"]["message"] == "empty"


async def test_each_chunk_leaves_when_it_is_written(proxied) -> None:
    url, backend = proxied
    async with aiohttp.ClientSession() as http, http.get(f"{url}/stream") as r:
        first = await asyncio.wait_for(r.content.readany(), 30)
        assert first == b"first"
        backend.first_chunk_seen.set()
        assert await r.content.read() == b"second"


async def test_a_stream_the_server_cut_is_cut(proxied) -> None:
    url, _ = proxied
    async with aiohttp.ClientSession() as http, http.get(f"{url}/cut") as r:
        assert r.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()


async def test_websocket_messages_and_subprotocol_go_both_ways(proxied) -> None:
    url, _ = proxied
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(
            f"{url.replace('http', 'ws')}/ws",
            headers={"Authorization": "Bearer k"},
            protocols=("realtime",),
        ) as ws,
    ):
        assert ws.protocol == "realtime"
        await ws.send_str("hello")
        assert (await ws.receive_str(timeout=30)) == "HELLO"
        await ws.send_bytes(b"\x01\x02")
        assert (await ws.receive_bytes(timeout=30)) == b"\x02\x01"


async def test_a_refused_upgrade_is_refused(proxied) -> None:
    url, _ = proxied
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            async with http.ws_connect(f"{url.replace('http', 'ws')}/ws"):
                pass
        assert refused.value.status == 401  # the server's own status, not a generic 403
