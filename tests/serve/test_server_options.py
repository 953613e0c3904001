"""The server process with its HTTP options: the API key from the environment with the official
client, the Host check of a loopback server, and the stop's grace period."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import urllib.request
from datetime import datetime

import openai
import pytest
from openai import OpenAI

from tests.helpers.server import EMBEDDED_REPO, ROOT, ServerProcess
from tests.serve.inline import MODEL, stand_in_repo

pytestmark = pytest.mark.timeout(180)

KEY = "sk-omni-test-key"
GRACE_S = 3.0


@pytest.fixture
def keyed_server(tmp_path):
    os.environ["OMNI_SERVER_API_KEY"] = KEY  # the server reads it; the command line stays clean
    try:
        server = ServerProcess.start(
            stand_in_repo(tmp_path / "repo"),
            tmp_path / "server.log",
            "--shutdown-grace",
            str(GRACE_S),
        )
    finally:
        del os.environ["OMNI_SERVER_API_KEY"]
    with server:
        yield server


def logged_at(log: str, message: str) -> float:
    """When the server logged the line that ends with `message` (its timestamp, in seconds)."""
    [line] = [line for line in log.splitlines() if line.endswith(message)]
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def raw_request(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_api_key_from_the_environment_with_the_official_client(keyed_server):
    url = keyed_server.url + "/v1"
    with OpenAI(base_url=url, api_key=KEY, max_retries=0) as client:
        audio = client.audio.speech.create(
            model=MODEL, voice="hush", input="hi", response_format="pcm"
        )
        assert audio.content == bytes(1440)
        assert [m.id for m in client.models.list().data] == [MODEL]
    with (
        OpenAI(base_url=url, api_key="sk-wrong", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError) as caught,
    ):
        client.models.list()
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    assert keyed_server.get_json("/health/live")[0] == 200  # probes need no key
    assert keyed_server.get_json("/health/ready")[0] == 200


def test_a_loopback_server_refuses_foreign_host_names(keyed_server):
    rebound = raw_request(
        keyed_server.port,
        b"GET /health/live HTTP/1.1\r\nHost: attacker.example:8000\r\nConnection: close\r\n\r\n",
    )
    assert rebound.startswith(b"HTTP/1.1 403") and b"host_not_allowed" in rebound
    garbage = raw_request(keyed_server.port, b"\x16\x03\x01 not http at all\r\n\r\n")
    assert garbage.split(b" ", 2)[1] == b"400" and b'"invalid_http"' in garbage
    assert b"not http at all" not in garbage
    assert b"Server: omni-server\r\n" in garbage


def test_stop_gives_requests_the_grace_period_then_cancels_them(keyed_server):
    """SIGTERM with one short and one long stream in flight: the short one completes, the long
    one is cancelled when the grace period ends (once, not twice), as `server_shutdown`."""
    outcomes: dict[str, str] = {}
    started = {name: threading.Event() for name in ("short", "long")}

    def listen(name: str, chunks: int) -> None:
        fields = {"model": MODEL, "input": f"slow {chunks}", "voice": "hush"}
        body = json.dumps({**fields, "response_format": "pcm"}).encode()
        request = urllib.request.Request(
            keyed_server.url + "/v1/audio/speech",
            data=body,
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                received = response.read(480)
                started[name].set()
                received += response.read()
            outcomes[name] = f"complete {len(received)}"
        except Exception as exc:  # noqa: BLE001  a cut stream is the expected outcome here
            outcomes[name] = f"cut: {type(exc).__name__}"
        finally:
            started[name].set()

    threads = [
        threading.Thread(target=listen, args=("short", 5)),  # 0.5 s (1 s beside the other)
        threading.Thread(target=listen, args=("long", 600)),  # 60 s
    ]
    for thread in threads:
        thread.start()
    assert all(event.wait(60) for event in started.values())
    keyed_server.terminate()
    keyed_server.proc.wait(60)
    for thread in threads:
        thread.join(60)
    log = keyed_server.log()
    assert outcomes["short"] == f"complete {5 * 480}"
    assert outcomes["long"].startswith("cut")
    assert f"cancelling 1 request(s) still running after {GRACE_S:g} s" in log
    assert "aborted: the server is shutting down" in log
    # one grace period, not aiohttp's two: timed by the server's own log, from the signal's
    # "stopping" to "stopped" (not the process's exit, which a loaded machine may delay)
    stopped_after = logged_at(log, "omni-server stopped") - logged_at(log, "omni-server stopping")
    assert GRACE_S <= stopped_after < 2 * GRACE_S - 0.5, stopped_after


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--max-in-flight", "0"], "max_in_flight must be at least 1"),
        (["--body-timeout", "-1"], "body_timeout_s must be positive"),
        (["--api-key", " "], "api_key is empty"),
        (["--start-timeout", "0"], "start_timeout_s must be positive"),
        (["--heartbeat-timeout", "0.5"], "heartbeat_timeout_s must be 0 (never) or more than"),
    ],
)
def test_bad_serve_options_exit_2_naming_them(flags, says):
    done = subprocess.run(
        [sys.executable, "-m", "omni_server", "--repo", str(EMBEDDED_REPO), *flags],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert says in done.stderr and "Traceback" not in done.stderr


def test_the_official_client_sees_429_as_a_rate_limit(tmp_path):
    with ServerProcess.start(
        stand_in_repo(tmp_path / "repo"),
        tmp_path / "server.log",
        "--max-in-flight",
        "1",
        "--max-queued",
        "0",
    ) as server:
        holder = socket.create_connection(("127.0.0.1", server.port), timeout=20)
        fields = {"model": MODEL, "input": "slow 100", "voice": "hush", "response_format": "pcm"}
        body = json.dumps(fields).encode()
        holder.sendall(
            b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert holder.recv(12) == b"HTTP/1.1 200"  # streaming: it holds the only place
        with (
            OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client,
            pytest.raises(openai.RateLimitError) as caught,
        ):
            client.audio.speech.create(model=MODEL, voice="hush", input="hello")
        holder.close()
    assert caught.value.code == "rate_limit_exceeded"
    assert caught.value.response.headers["retry-after"] == "1"
