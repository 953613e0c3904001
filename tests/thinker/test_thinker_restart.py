"""A thinker killed in a running server comes back on the weights its predecessor prepared: the
successor maps the run's prepared file instead of reading and dequantizing the GGUF (the log
says which a load did), answers, and the file goes with the run directory when the server
stops. A real server (`python -m omni_server`) on a repository of one thinker stage, the
embedded thinker's backend on a tiny random GGUF (tests/fixtures/tiny_gguf.py)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.fixtures.tiny_gguf import write_tiny_gguf
from tests.helpers.proc import descendants
from tests.helpers.server import EMBEDDED_REPO, ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WRITTEN = "prepared weights written"
MAPPED = "prepared weights mapped read-only"
RESTARTED = "stage process thinker@r0 restarted"
_WAIT_S = 120.0  # a safety net only: a restart on the tiny model takes seconds


def _repository(root: Path) -> Path:
    repo = root / "repo"
    (repo / "thinker").mkdir(parents=True)
    shutil.copy(EMBEDDED_REPO / "thinker" / "model.py", repo / "thinker" / "model.py")
    gguf = write_tiny_gguf(root / "tiny.gguf")
    (repo / "thinker" / "stage.toml").write_text(
        f"""backend = "model.py:Thinker"
process = "thinker"
terminal = true

[scheduler]
kind = "ar"

[engine]
max_total_tokens = 256
max_batch_size = 4
max_step_tokens = 64

[parameters]
checkpoint = "{gguf}"
"""
    )
    (repo / "repository.toml").write_text(
        """[models.tiny-chat]
entry = "thinker"
tasks = ["chat"]
"""
    )
    return repo


def _thinker_pid(server: ServerProcess) -> int:
    for pid in descendants(server.proc.pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"omni_server.stage.worker" in command:
            return pid
    raise AssertionError("no thinker process")


def _wait_for_line(server: ServerProcess, text: str) -> None:
    deadline = time.monotonic() + _WAIT_S
    while text not in server.log():
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{server.log_tail()}"
        time.sleep(0.1)


def _chat(server: ServerProcess) -> httpx.Response:
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def test_a_killed_thinker_comes_back_on_the_prepared_weights(tmp_path: Path) -> None:
    with ServerProcess.start(_repository(tmp_path), tmp_path / "server.log") as server:
        # the first thinker prepared the weights (logged before it reported ready)
        log = server.log()
        assert log.count(WRITTEN) == 1 and MAPPED not in log, server.log_tail()
        match = re.search(r"(/\S+/omni-run-[^/\s]+)/prepared/\S+\.safetensors", log)
        assert match is not None, server.log_tail()
        run_dir = Path(match.group(1))
        first = _thinker_pid(server)
        os.kill(first, signal.SIGKILL)
        _wait_for_line(server, RESTARTED)
        log = server.log()
        # the successor mapped the file; nothing was prepared a second time
        assert log.count(MAPPED) == 1 and log.count(WRITTEN) == 1, server.log_tail()
        assert _thinker_pid(server) != first
        response = _chat(server)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] >= 1
        assert [p.name for p in (run_dir / "prepared").iterdir()] == [match.group(0).split("/")[-1]]
    assert not run_dir.exists()  # the prepared file went with the run directory
