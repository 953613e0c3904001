"""`omni-server ray` stopped by SIGTERM, as systemd, Docker and Kubernetes stop it.

The real command in a process of its own (its own local Ray instance, Serve's proxy on a free
port, one pipeline replica of the embedded repository, Ray's temp directory and TMPDIR private
to the test, as in conftest.py). A streamed speech request is running when SIGTERM arrives: the
stop is the single-host server's, the stream goes on to its end, a new request meanwhile gets
the replica's own 503 (OpenAI's error JSON, Retry-After), the command exits 0, and nothing of it
is left: no process, no segment of the replica's pipeline, no run directory, the port free.
SIGTERM while the replica's pipeline is still starting stops it as cleanly, and a deployment
that fails exits 1, as cleanly.
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
from collections.abc import Iterator
from dataclasses import dataclass, field
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
from tests.helpers.repo import make_repo, toml
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


def _group(pgid: int) -> list[int]:
    """The live members of a process group (it outlives its leader while a member lives)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # ended while we looked
        if int(stat.rsplit(")", 1)[1].split()[2]) == pgid and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def _naming(root: Path) -> list[int]:
    """The live processes whose command line names `root`."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        if str(root) in command_of(pid) and alive(pid):
            found.append(pid)
    return found


@dataclass
class Command:
    """`omni-server ray` in a process group of its own, with Ray's temp directory and TMPDIR
    under `root`; `stopped()` is what was left once it exited."""

    proc: subprocess.Popen
    root: Path
    log: Path
    port: int
    family: list[int] = field(default_factory=list)  # its descendants when it was signalled
    run_ids: set[str] = field(default_factory=set)  # the runs of its stage processes by then
    mapped: set[str] = field(default_factory=set)  # the segments its processes mapped by then

    @classmethod
    def start(
        cls, root: Path, log: Path, repo: Path = REPOSITORY, overrides: tuple[str, ...] = OVERRIDES
    ) -> Command:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"TMPDIR": str(root)}
        port = free_port()
        command = [sys.executable, "-m", "omni_server", "ray", "--repo", str(repo)]
        command += ["--port", str(port), "--api-key", API_KEY, "--shutdown-grace", str(GRACE_S)]
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [*command, *overrides],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=env,
                start_new_session=True,  # its own process group: a stray child is still found
            )
        return cls(proc, root, log, port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while "omni-server ready on" not in self.log.read_text(errors="replace"):
            assert self.proc.poll() is None, f"exited with {self.proc.returncode}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"not ready in {READY_TIMEOUT_S} s:\n{self.tail()}"
            time.sleep(0.5)

    def sigterm(self) -> None:
        """SIGTERM, noting first what it must leave nothing of."""
        self.family = descendants(self.proc.pid)
        self.run_ids = worker_run_ids(self.family)
        self.mapped = mapped_segments([self.proc.pid, *self.family])
        self.proc.send_signal(signal.SIGTERM)

    def exit_code(self) -> int:
        return self.proc.wait(EXIT_TIMEOUT_S)

    def left_over(self) -> list[str]:
        """What outlived the command: processes, segments of its runs, run directories, a
        listener on its port. Ray's own processes may take a moment to go after it exits."""
        deadline = time.monotonic() + LEFT_OVER_WAIT_S
        while time.monotonic() < deadline and (
            any(alive(p) for p in self.family) or _group(self.proc.pid)
        ):
            time.sleep(0.2)
        left = [f"process {p}: {command_of(p)}" for p in self.family if alive(p)]
        left += [f"process {p} of its group: {command_of(p)}" for p in _group(self.proc.pid)]
        # one started after SIGTERM is not in the family: every process of ours names the root
        # in its command line (the stage processes their run directory, Ray's its session's)
        left += [
            f"process {p}: {command_of(p)}" for p in _naming(self.root) if p not in self.family
        ]
        names = self.mapped.union(*(run_segments(r) for r in self.run_ids))
        left += [f"/dev/shm/{n}" for n in sorted(names) if (SHM / n).exists()]
        left += [f"run directory {p}" for p in sorted(self.root.glob("omni-run-*"))]
        if not _port_free(self.port):
            left.append(f"a listener on port {self.port}")
        return left

    def kill(self) -> None:
        """Teardown whatever the outcome: SIGKILL to what is left of the command."""
        for pid in [self.proc.pid, *self.family, *descendants(self.proc.pid)]:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="rb24-", dir="/tmp"))  # short: Ray's socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_sigterm_drains_the_stream_refuses_new_requests_and_leaves_nothing(root, tmp_path):
    command = Command.start(root, tmp_path / "ray.log")
    stream, first_chunk = Stream(), threading.Event()
    listener = threading.Thread(target=_stream_speech, args=(command.url, stream, first_chunk))
    try:
        command.wait_ready()
        listener.start()
        assert first_chunk.wait(GRACE_S) and stream.status == 200, stream
        command.sigterm()
        assert command.run_ids, "no stage process was found under the command"
        signalled_at = time.monotonic()
        refusal = _first_refusal(command.url, timeout=60)
        listener.join(GRACE_S + 30)
        code = command.exit_code()
        exited_at = time.monotonic()
        left = command.left_over()
    finally:
        if listener.is_alive():
            listener.join(5)
        command.kill()
    tail = command.tail()
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
    assert left == []


def test_sigterm_while_the_replica_starts_stops_it_and_leaves_nothing(root, tmp_path):
    """A stop during a start (a rollout that gives up on a pod still loading) is not held up
    until every replica serves: the replica's start is cancelled and reaped like a running one."""
    command = Command.start(root, tmp_path / "ray.log")
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not worker_run_ids(descendants(command.proc.pid)):  # the pipeline is starting
            assert command.proc.poll() is None, command.tail()
            assert time.monotonic() < deadline, f"no stage process started:\n{command.tail()}"
            time.sleep(0.1)
        command.sigterm()
        code = command.exit_code()
        left = command.left_over()
    finally:
        command.kill()
    tail = command.tail()
    assert "omni-server ready on" not in tail  # stopped while starting, not waited for
    assert code == 0, tail
    assert "omni-server stopped" in tail
    assert left == []


FAILING_STAGE = """\
from omni_server.backend import StageBackend


class Broken(StageBackend):
    def initialize(self, context):
        raise RuntimeError("this stage cannot start")

    def execute(self, requests):
        return [dict(r.inputs) for r in requests]
"""


def test_a_deployment_that_fails_exits_1_and_leaves_nothing(root, tmp_path):
    repo = make_repo(
        tmp_path / "repo",
        stages={
            "broken": toml("""
            backend = "Broken"
            terminal = true
            """)
        },
        repository=toml("""
            [models.m]
            entry = "broken"
            tasks = ["speech"]
            """),
        models={"broken": FAILING_STAGE},
    )
    command = Command.start(root, tmp_path / "ray.log", repo, overrides=())
    try:
        code = command.proc.wait(READY_TIMEOUT_S)  # Serve tries the replica a few times first
        left = command.left_over()
    finally:
        command.kill()
    tail = command.tail()
    assert code == 1, tail
    # the whole log: Ray's controller may print its own traceback after ours, past the tail
    log = command.log.read_text(errors="replace")
    assert "the application failed to deploy" in log and "this stage cannot start" in log, tail
    assert left == []
