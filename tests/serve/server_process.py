"""A real `python -m omni_server` process for tests: started, awaited, stopped, checked for leaks.

    with ServerProcess.start(repo, log_path, "--stages.acoustic.process", "pipeline") as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none")

On exit the server gets SIGTERM and must exit 0 within the grace period, leaving none of its
descendant processes and none of the shared-memory segments it created.
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
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED_REPO = ROOT / "repository"
SHM = Path("/dev/shm")
START_TIMEOUT_S = 120.0  # stage processes import onnxruntime and load the voice
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            out.extend(int(c) for c in children)
            todo.extend(int(c) for c in children)
    return out


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def segments_mapped_by(pids: list[int]) -> set[str]:
    """The /dev/shm/omni-* segments these processes have mapped. (Other test runs on the machine
    create segments too, so a leak check must look only at the server's own.)"""
    found = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[-1]
            if path.startswith(str(SHM / "omni-")):
                found.add(path.removesuffix(" (deleted)"))
    return found


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: Path
    _terminated: tuple[list[int], set[str]] | None = None

    @classmethod
    def start(
        cls, repo: Path, log_path: Path, *overrides: str, wait_ready: bool = True
    ) -> ServerProcess:
        port = free_port()
        log = log_path.open("wb")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "omni_server",
                "--repo",
                str(repo),
                "--port",
                str(port),
                *overrides,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        log.close()  # the child holds its own descriptor
        server = cls(proc, f"http://127.0.0.1:{port}", log_path)
        try:
            if wait_ready:
                server.wait_ready()
        except BaseException:
            server.stop(check=False)
            raise
        return server

    def wait_live(self) -> None:
        self._wait_for("/health/live")

    def wait_ready(self) -> None:
        self._wait_for("/health/ready")

    def _wait_for(self, path: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"no 200 from {path} after {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

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
        self._terminated = (family, segments_mapped_by([self.proc.pid, *family]))
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, check: bool = True) -> None:
        """SIGTERM; with `check`, assert a clean exit that leaves no process or segment."""
        if self._terminated is None:
            self.terminate()
        family, mapped = self._terminated
        try:
            code = self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for pid in [self.proc.pid, *family]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait()
            if check:
                raise AssertionError(f"server ignored SIGTERM for {STOP_TIMEOUT_S} s") from None
            return
        if not check:
            return
        assert code == 0, f"server exited with {code}:\n{self.log()[-4000:]}"
        deadline = time.monotonic() + 10
        while any(running(p) for p in family) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in family if running(p)]
        assert not left, f"stage processes outlived the server: {left}"
        leaked = sorted(path for path in mapped if Path(path).exists())
        assert not leaked, f"shared-memory segments outlived the server: {sorted(leaked)}"

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop(check=exc[0] is None)
