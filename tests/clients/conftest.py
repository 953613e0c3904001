"""One real omni-server process for all client tests (`python -m omni_server --repo repository`).

Set OMNI_CLIENT_TESTS_URL to run the tests against a server that is already running instead.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = ROOT / "repository"
READY_TIMEOUT_S = 180.0  # loading the voice and starting the stage processes, on 2 slow cores
STOP_TIMEOUT_S = 30.0

# a few sentences: the server streams one chunk per sentence at least
SENTENCES = "The quick brown fox jumps over the lazy dog. It was not amused. Then it slept."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"omni-server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx2.get(f"{url}/health/ready", timeout=2.0).status_code == 200:
                return
        except httpx2.TransportError:
            pass
        time.sleep(0.3)
    pytest.fail(f"omni-server not ready after {READY_TIMEOUT_S:.0f} s:\n{log.read_text()[-3000:]}")


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL for the whole session if the server does not exit in time."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            pytest.fail(f"omni-server ignored SIGTERM for {STOP_TIMEOUT_S:.0f} s")
    # the server's own stage processes must be gone with it; any left over is a leak
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    pytest.fail("omni-server exited but left processes of its session running")


@pytest.fixture(scope="package")
def server_url() -> Iterator[str]:
    external = os.environ.get("OMNI_CLIENT_TESTS_URL")
    if external:
        yield external.rstrip("/")
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w+", prefix="omni-server-", suffix=".log") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "omni_server", "--repo", str(REPOSITORY), "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,  # its own process group: teardown can find every child
        )
        try:
            _wait_ready(url, process, Path(log.name))
            yield url
        finally:
            _stop(process)


@pytest.fixture
def unreachable_url() -> str:
    """A local port nothing listens on (connection refused at once)."""
    return f"http://127.0.0.1:{free_port()}"
