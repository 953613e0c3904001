"""Malformed multipart uploads on `/v1/audio/transcriptions` (issue 27.4): each is a 400 in
OpenAI's error JSON, and the server log holds no traceback, nor aiohttp's "Unhandled exception",
for a client's mistake.

The app is served on a real loopback socket with the server's own connection handling
(tests/serve/inline.py `listening`) over the stand-in pipeline; the bodies are raw bytes, as a
hostile client sends them, and the log is the test's own capture of every logger.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging

import pytest

from omni_server.serve import create_app
from omni_server.serve.options import ServeOptions
from tests.serve.inline import listening

pytestmark = pytest.mark.timeout(120)

B = "bnd"
PART = f'--{B}\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n'


def _file_part(disposition: str = 'form-data; name="file"; filename="a.wav"', extra="") -> str:
    return f"--{B}\r\nContent-Disposition: {disposition}\r\n{extra}\r\nRIFF....\r\n"


MALFORMED = {
    "no closing boundary": (PART + _file_part()).encode(),
    "100 KB part header": (
        PART + _file_part(extra=f"X-Long: {'a' * 100_000}\r\n") + f"--{B}--\r\n"
    ).encode(),
    "100 KB filename": (
        PART
        + _file_part(f'form-data; name="file"; filename="{"f" * 100_000}.wav"')
        + f"--{B}--\r\n"
    ).encode(),
    "5,000 part headers": (
        PART + _file_part(extra="".join(f"X-H{i}: v\r\n" for i in range(5000))) + f"--{B}--\r\n"
    ).encode(),
    "NUL in the filename": (
        PART + _file_part('form-data; name="file"; filename="a\x00b.wav"') + f"--{B}--\r\n"
    ).encode(),
}


async def _post(port: int, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(
        (
            f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: multipart/form-data; boundary={B}\r\n"
            f"Content-Length: {len(body)}\r\n{head}\r\n"
        ).encode()
        + body
    )
    await writer.drain()
    status_line = await reader.readline()
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    payload = await reader.readexactly(length)
    writer.close()
    await asyncio.sleep(0.2)  # let the server finish with the connection (and log, if it does)
    return int(status_line.split()[1]), json.loads(payload)


@pytest.fixture
async def port(stand_in_runtime):
    options = ServeOptions()
    async with listening(create_app(stand_in_runtime, options=options), options) as port:
        yield port


def _assert_quiet_log(caplog) -> None:
    for record in caplog.records:
        text = record.getMessage()
        assert record.exc_info is None, f"a traceback was logged: {text}"
        assert "Unhandled exception" not in text and record.levelno < logging.ERROR, text


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_malformed_multipart_is_a_400_without_a_traceback(port, caplog, case):
    caplog.set_level(logging.DEBUG)
    status, body = await _post(port, MALFORMED[case], {})
    assert status == 400, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["code"] in ("invalid_request", "invalid_value")
    _assert_quiet_log(caplog)


async def test_a_gzip_declared_body_that_is_not_gzip_is_a_quiet_400(port, caplog):
    caplog.set_level(logging.DEBUG)
    status, body = await _post(port, b"not gzip at all" * 100, {"Content-Encoding": "gzip"})
    assert status == 400 and body["error"]["code"] == "invalid_body"
    _assert_quiet_log(caplog)


async def test_a_gzip_body_broken_after_its_first_parts_is_a_quiet_400(port, caplog):
    """The form's first part inflates; the rest of the stream is garbage."""
    caplog.set_level(logging.DEBUG)
    good = gzip.compress(PART.encode())
    status, body = await _post(port, good[:-8] + b"\xff" * 4000, {"Content-Encoding": "gzip"})
    assert status == 400, body
    _assert_quiet_log(caplog)
