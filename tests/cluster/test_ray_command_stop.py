"""`omni-server ray` stopped by SIGTERM, as systemd, Docker and Kubernetes stop it.

The real command in a process of its own (its own local Ray instance, Serve's proxy on a free
port, one pipeline replica of the embedded repository, Ray's temp directory and TMPDIR private
to the test, as in conftest.py): a streamed speech request is running when SIGTERM arrives. The
stop is the single-host server's: the stream goes on to its end, a new request meanwhile gets
the replica's own 503 (OpenAI's error JSON, Retry-After), the command exits 0, and nothing of it
is left: no process, no segment of the replica's pipeline, no run directory, the port free.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest

from tests.cluster.conftest import API_KEY, OVERRIDES, REPOSITORY  # skips without ray
from tests.helpers.proc import (
    SHM,
    alive,
    command_of,
    descendants,
    mapped_segments,
    run_segments,
    worker_run_ids,
)
from tests.helpers.server import ROOT, free_port
from tests.serve.speech_texts import MANY_SENTENCES

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

# The stream's time to finish after SIGTERM: long, so that a machine loaded by other suites
# finishes it too; an idle drain ends as soon as the stream does, not after the grace.
GRACE_S = 120
READY_TIMEOUT_S = 480  # a local Ray instance, Serve, and one replica's voice, Whisper, thinker
EXIT_TIMEOUT_S = GRACE_S + 180  # the drain, then Serve's stop of the replica, then Ray's
LEFT_OVER_WAIT_S = 60  # Ray's own processes may take a moment to go after the command exits
# Twice MANY_SENTENCES (under the 4,096 characters of an input): the voice is still speaking
# well after the drain has begun.
TEXT = " ".join([MANY_SENTENCES] * 2)
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@dataclass
class Stream:
    status: int = 0
    audio_bytes: int = 0
    completed: bool = False  # the whole body, its chunked end included
    last_chunk_at: float = 0.0
    error: str = ""


def _stream_speech(url: str, out: Stream, first_chunk: threading.Event) -> None:
    try:
        with httpx2.stream(
            "POST",
            f"{url}/v1/audio/speech",
            json={"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "pcm"},
            headers=AUTH,
            timeout=GRACE_S,
        ) as response:
            out.status = response.status_code
            for chunk in response.iter_bytes():
                out.audio_bytes += len(chunk)
                out.last_chunk_at = time.monotonic()
                first_chunk.set()
            out.completed = response.status_code == 200
    except httpx2.HTTPError as exc:  # a cut stream: what the drain must not do to it
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        first_chunk.set()


def _wait_ready(proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while "omni-server ready on" not in log.read_text(errors="replace"):
        tail = log.read_text(errors="replace")[-4000:]
        assert proc.poll() is None, f"omni-server ray exited with {proc.returncode}:\n{tail}"
        assert time.monotonic() < deadline, f"not ready after {READY_TIMEOUT_S} s:\n{tail}"
        time.sleep(0.5)


def _first_refusal(url: str, timeout: float) -> tuple[httpx2.Response, float] | None:
    """A new request, again and again from SIGTERM on, until one is refused: that one, and when."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx2.HTTPError):
            response = httpx2.get(f"{url}/v1/models", headers=AUTH, timeout=30)
            if response.status_code != 200:
                return response, time.monotonic()
        time.sleep(0.05)
    return None


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not a listener
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kill(proc: subprocess.Popen, family: list[int]) -> None:
    """Teardown whatever the outcome: SIGKILL to what is left of the command."""
    for pid in [proc.pid, *family]:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_sigterm_drains_the_stream_refuses_new_requests_and_leaves_nothing(tmp_path):
    root = Path(tempfile.mkdtemp(prefix="rb24-", dir="/tmp"))  # short: Ray's socket paths
    try:
        _sigterm_drains_and_leaves_nothing(root, tmp_path / "ray.log")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _sigterm_drains_and_leaves_nothing(root: Path, log: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"TMPDIR": str(root)}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "omni_server", "ray", "--repo", str(REPOSITORY)]
    command += ["--port", str(port), "--api-key", API_KEY, "--shutdown-grace", str(GRACE_S)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*command, *OVERRIDES],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            start_new_session=True,  # its own process group: a stray child is still found
        )
    family: list[int] = []
    stream, first_chunk = Stream(), threading.Event()
    listener = threading.Thread(target=_stream_speech, args=(url, stream, first_chunk))
    try:
        _wait_ready(proc, log)
        listener.start()
        assert first_chunk.wait(GRACE_S) and stream.status == 200, stream
        family = descendants(proc.pid)
        run_ids = worker_run_ids(family)
        mapped = mapped_segments([proc.pid, *family])
        assert run_ids, "no stage process was found under the command"
        proc.send_signal(signal.SIGTERM)
        signalled_at = time.monotonic()
        refusal = _first_refusal(url, timeout=60)
        listener.join(GRACE_S + 30)
        code = proc.wait(EXIT_TIMEOUT_S)
        exited_at = time.monotonic()
        deadline = time.monotonic() + LEFT_OVER_WAIT_S
        while any(alive(p) for p in family) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [(p, command_of(p)) for p in family if alive(p)]
        group_alive = _group_exists(proc.pid)
    finally:
        if listener.is_alive():
            listener.join(5)
        _kill(proc, family)
    tail = log.read_text(errors="replace")[-4000:]
    refused_after = (refusal[1] if refusal else signalled_at) - signalled_at
    print(  # what the stop took here (pytest -s shows it): not asserted, the machine's load is
        f"SIGTERM -> first refusal {refused_after:.2f} s, "
        f"-> the stream's end {stream.last_chunk_at - signalled_at:.2f} s, "
        f"-> exit {exited_at - signalled_at:.2f} s"
    )
    # the stream in flight at SIGTERM went on to its end, after the drain had begun
    assert stream.completed and not stream.error, (stream, tail)
    assert refusal is not None, f"no request was refused during the stop:\n{tail}"
    response, refused_at = refusal
    assert stream.last_chunk_at > refused_at, "the stream ended before the drain began"
    # the refusal is the replica's own server's: OpenAI's error JSON, with Retry-After
    assert response.status_code == 503, (response.status_code, response.text)
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert int(response.headers["Retry-After"]) > 0
    assert response.headers["X-Omni-Replica"]
    assert code == 0, tail
    assert "omni-server stopped" in tail
    assert left == [], left
    assert not group_alive, "a process of the command's group outlived it"
    names = mapped.union(*(run_segments(r) for r in run_ids))
    assert sorted(n for n in names if (SHM / n).exists()) == []
    assert sorted(p.name for p in root.glob("omni-run-*")) == []
    assert _port_free(port)


def _group_exists(pgid: int) -> bool:
    """The group outlives its leader while a member lives."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
