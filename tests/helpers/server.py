"""A real `python -m omni_server` process for tests: started, awaited, stopped, checked for leaks.

    with ServerProcess.start(repo, tmp_path / "server.log", "--stages.a.process", "p") as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")

On exit the server gets SIGTERM and must exit 0 within the grace period, leaving none of its
descendant processes (nor any process of its session) and none of its shared-memory segments:
the ones it mapped and every `omni-RUN_ID-*` of its runtime's run. Only the server's own
segments are checked: other test runs on the machine create segments too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.proc import (
    SHM,
    alive,
    descendants,
    mapped_segments,
    run_segments,
    worker_run_ids,
)

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED_REPO = ROOT / "repository"
# The embedded repository with only its voice loaded (Triton's explicit model control): a server
# of its own for a test about speech starts in seconds, without the Whisper and SmolLM2 loads
# that make the shared `embedded_server` the suite's costliest fixture.
VOICE_ONLY = ("--model-control-mode", "explicit", "--load-model", "piper-joe")
START_TIMEOUT_S = 180.0  # stage processes import onnxruntime and load the voice, on 2 slow cores
STOP_TIMEOUT_S = 30.0
EXIT_GRACE_S = 10.0  # stage processes may outlive the server by a moment
LOG_TAIL = 4000
PORT_ATTEMPTS = 3


class PortTaken(RuntimeError):
    """The server exited because another process bound its port first."""


def failed_start_line(repo: Path, timeout: float = 120) -> str:
    """Start `omni-server` on a repository that must fail to start: it exits 1, logs exactly
    one ERROR line and no traceback; that line is returned."""
    done = subprocess.run(
        [sys.executable, "-m", "omni_server", "--repo", str(repo), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return errors[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class _Snapshot:
    """What the server had just before SIGTERM: what `stop()` checks is gone."""

    family: list[int]
    segments: set[str]
    run_ids: set[str]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: Path
    _snapshot: _Snapshot | None = field(default=None, repr=False)

    @classmethod
    def start(
        cls, repo: Path, log_path: Path, *overrides: str, wait_ready: bool = True
    ) -> ServerProcess:
        """Start a server on a free port with command-line `overrides`; by default wait until
        `/health/ready` answers 200. If that fails, the server is stopped and the error says why,
        with the tail of its log.

        The port is free when `free_port()` looks, not necessarily when the server binds it a
        moment later (another process on the machine may take it in between): a server that
        exits saying it cannot listen is started again on another port."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            server = cls._launch(repo, log_path, overrides)
            try:
                if wait_ready:
                    server.wait_ready()
                return server
            except PortTaken:
                server.stop(check=False)
                if attempt == PORT_ATTEMPTS:
                    raise
            except BaseException:
                server.stop(check=False)
                raise
        raise AssertionError("unreachable")

    @classmethod
    def _launch(cls, repo: Path, log_path: Path, overrides: tuple[str, ...]) -> ServerProcess:
        port = free_port()
        command = [sys.executable, "-m", "omni_server", "--repo", str(repo), "--port", str(port)]
        with log_path.open("wb") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [*command, *overrides],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,  # its own process group: a stray child is still found
            )
        return cls(proc, f"http://127.0.0.1:{port}", log_path)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def wait_live(self, timeout_s: float = START_TIMEOUT_S) -> None:
        self._wait_for("/health/live", timeout_s)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        self._wait_for("/health/ready", timeout_s)

    def _wait_for(self, path: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if f"cannot listen on 127.0.0.1:{self.port}" in self.log():
                    raise PortTaken(f"port {self.port} was taken before the server bound it")
                raise RuntimeError(
                    f"omni-server exited with {self.proc.returncode} before {path} answered 200; "
                    f"its log ends:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + path, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise TimeoutError(
            f"omni-server: no 200 from {path} after {timeout_s:.0f} s; its log ends:\n"
            f"{self.log_tail()}"
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self) -> str:
        return self.log()[-LOG_TAIL:]

    def run_ids(self) -> set[str]:
        """Run ids of the server's stage (worker) processes now."""
        return worker_run_ids(descendants(self.proc.pid))

    def get_json(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            return response.read().decode()

    def terminate(self) -> None:
        """Send SIGTERM, noting first the processes and segments `stop()` checks are gone."""
        family = descendants(self.proc.pid)
        self._snapshot = _Snapshot(
            family, mapped_segments([self.proc.pid, *family]), worker_run_ids(family)
        )
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, check: bool = True) -> None:
        """SIGTERM (unless `terminate()` sent it); with `check`, assert a clean exit: code 0, no
        process left, no segment left. Whatever the outcome, nothing of the server survives."""
        if self._snapshot is None:
            self.terminate()
        snapshot = self._snapshot
        try:
            code = self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._kill_all(snapshot.family)
            if check:
                raise AssertionError(
                    f"omni-server ignored SIGTERM for {STOP_TIMEOUT_S:.0f} s; its log ends:\n"
                    f"{self.log_tail()}"
                ) from None
            return
        deadline = time.monotonic() + EXIT_GRACE_S
        while self._left_over(snapshot.family) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = self._left_over(snapshot.family)
        if left:
            self._kill_all(snapshot.family)
        if not check:
            return
        assert code == 0, f"omni-server exited with {code} after SIGTERM:\n{self.log_tail()}"
        assert not left, f"processes outlived the server: {left}"
        names = snapshot.segments.union(*(run_segments(r) for r in snapshot.run_ids))
        leaked = sorted(name for name in names if (SHM / name).exists())
        assert not leaked, f"shared-memory segments outlived the server: {leaked}"

    def _left_over(self, family: list[int]) -> list[int | str]:
        left: list[int | str] = [p for p in family if alive(p)]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 0)  # the group outlives its leader while a member lives
            left.append(f"process group {self.proc.pid}")
        return left

    def _kill_all(self, family: list[int]) -> None:
        """SIGKILL to the server, its living descendants and its process group (teardown)."""
        self.proc.kill()  # a no-op once the server is reaped: its pid may be reused
        for pid in family:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop(check=exc[0] is None)
