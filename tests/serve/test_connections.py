"""Connections on a real socket, served as the server serves them (timeouts.make_runner):
malformed HTTP, declared sizes, encodings, and the header, body and idle timeouts."""

from __future__ import annotations

import asyncio
import gzip
import json

import pytest

from omni_server.serve import create_app
from omni_server.serve.options import ServeOptions
from tests.serve.inline import listening

pytestmark = pytest.mark.timeout(60)

SPEECH_BODY = (
    b'{"model": "quiet", "input": "hello there", "voice": "hush", "response_format": "pcm"}'
)


def post(body: bytes, *headers: str, length: int | None = None) -> bytes:
    lines = [
        "POST /v1/audio/speech HTTP/1.1",
        "Host: 127.0.0.1",
        "Connection: close",
        "Content-Type: application/json",  # speech takes JSON bodies only (415 otherwise)
        f"Content-Length: {len(body) if length is None else length}",
        *headers,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def exchange(port: int, raw: bytes, *, then_close: bool = False):
    """Send `raw`, read the response until the server closes; (status, headers, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        if then_close:
            writer.close()
            return None
        data = await asyncio.wait_for(reader.read(), 20)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    return int(status_line.split()[1]), headers, body


@pytest.fixture
def serving(stand_in_runtime):
    """`async with serving(**options) as port`: the app on a socket of its own."""

    def start(**fields):
        options = ServeOptions(**fields)
        return listening(create_app(stand_in_runtime, options=options), options)

    return start


def error_json(body: bytes) -> dict:
    return json.loads(body)["error"]


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"GARBAGE-METHOD-\x01 / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", "method"),
        (b"GET /" + b"secret-path" * 1000 + b" HTTP/1.1\r\nHost: a\r\n\r\n", "longer"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nX-Secret: " + b"v" * 9000 + b"\r\n\r\n", "longer"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nBad Header\x00: x\r\n\r\n", "not valid http"),
        (
            b"POST /v1/audio/speech HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"ffffffffffffffffffffffff\r\nsecret\r\n",
            "not valid http",
        ),
        (post(b"{}", "Content-Encoding: br"), "encoding"),
    ],
    ids=["method", "long-target", "long-header", "bad-header", "absurd-chunk", "brotli"],
)
async def test_malformed_http_gets_openai_json_without_echo(serving, raw, says):
    async with serving() as port:
        status, headers, body = await exchange(port, raw)
    assert status == 400
    assert headers["content-type"].startswith("application/json")
    assert headers["server"] == "omni-server"
    error = error_json(body)
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_http"
    assert says in error["message"].lower()
    for echoed in (b"GARBAGE", b"secret", b"vvvv", b"Bad Header", b"Brotli"):
        assert echoed not in body


async def test_declared_content_length_over_the_limit_is_refused_before_the_body(serving):
    async with serving(max_body_bytes=1000, body_timeout_s=60) as port:
        # no byte of the body is sent: an answer proves the server did not wait for it
        status, _, body = await exchange(port, post(b"", length=10**9))
    assert status == 413
    assert error_json(body)["code"] == "request_too_large"
    assert "1000000000 bytes" in error_json(body)["message"]


async def test_a_chunked_body_is_cut_off_at_the_limit_not_at_its_declared_chunk(serving):
    async with serving(max_body_bytes=1000, body_timeout_s=60) as port:
        chunked = (
            b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n10000000\r\n" + b"x" * 2000
        )  # a 256 MiB chunk announced; 2000 bytes of it sent
        status, _, body = await exchange(port, chunked)
    assert status == 413 and error_json(body)["code"] == "request_too_large"


async def test_content_encodings(serving):
    async with serving() as port:
        status, _, body = await exchange(
            port, post(gzip.compress(SPEECH_BODY), "Content-Encoding: gzip")
        )
        assert status == 200 and body  # a real gzip body is decoded
        status, _, body = await exchange(port, post(SPEECH_BODY, "Content-Encoding: gzip"))
        assert status == 400 and error_json(body)["code"] == "invalid_body"
        status, _, body = await exchange(port, post(SPEECH_BODY, "Content-Encoding: gzip, gzip"))
        assert status == 415 and error_json(body)["code"] == "unsupported_content_encoding"
        status, _, body = await exchange(port, post(SPEECH_BODY, "Content-Encoding: foo"))
        assert status == 415


async def test_a_slow_body_gets_408(serving):
    async with serving(body_timeout_s=0.3) as port:
        status, _, body = await exchange(port, post(SPEECH_BODY[:10], length=100))
    assert status == 408
    assert error_json(body)["code"] == "request_timeout"


async def test_slow_headers_and_idle_connections_are_closed(serving):
    async with serving(header_timeout_s=0.3, idle_timeout_s=0.6) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never ends
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing answered
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # says nothing
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        # a connection that keeps its requests coming within the timeouts is served
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(2):
            writer.write(b"GET /health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            await asyncio.sleep(0.2)
        writer.close()


async def test_a_client_leaving_mid_upload_is_a_disconnect_not_a_500(serving):
    metrics_request = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    counted = (
        'omni_request_failures_total{endpoint="speech",model="unknown",'
        'reason="client_disconnected"} 1.0'
    )
    async with serving() as port:
        await exchange(port, post(SPEECH_BODY[:20], length=1000), then_close=True)
        for _ in range(100):
            _, _, body = await exchange(port, metrics_request)
            metrics = body.decode()
            if counted in metrics:
                break
            await asyncio.sleep(0.05)
    assert counted in metrics
    assert 'status="500"' not in metrics and "server_error" not in metrics


async def test_a_client_that_stops_reading_is_dropped_and_frees_its_place(serving):
    async with serving(write_timeout_s=0.5, max_in_flight=1, max_queued=0) as port:
        body = b'{"model": "quiet", "input": "big 64", "voice": "hush", "response_format": "pcm"}'
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post(body))
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 20)
        assert head.startswith(b"HTTP/1.1 200")
        # read nothing more: 64 MiB cannot fit the socket buffers, the server's write waits
        status = 429
        for _ in range(200):
            status, _, _ = await exchange(port, post(SPEECH_BODY))
            if status == 200:
                break
            await asyncio.sleep(0.05)
        assert status == 200  # the stalled request gave its place back
        _, _, metrics = await exchange(
            port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )
        writer.close()
    assert b'model="quiet",reason="client_disconnected"} 1.0' in metrics
