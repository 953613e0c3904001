"""The harness end to end: a real `omni_server` process on the embedded repository, driven by
`omni-bench speech` for a few seeded, streamed requests, with the in-process peer and WER."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from omni_bench.peers import free_port

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 120.0


@pytest.fixture
def server(tmp_path):
    port = free_port()
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "omni_server", "--repo", str(ROOT / "repository"),
         "--port", str(port)],
        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{_tail(tmp_path)}")
            try:
                with urllib.request.urlopen(f"{url}/health/ready", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready in {READY_TIMEOUT_S}s:\n{_tail(tmp_path)}")
            time.sleep(0.25)
        run_ids = _run_ids(proc.pid)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
    # This server's own segments (other suites on the machine may hold theirs): none may remain.
    assert run_ids, "found no worker process of the server"
    assert proc.returncode == 0, f"server exit code {proc.returncode} after SIGTERM"
    leaked = [p.name for rid in run_ids for p in Path("/dev/shm").glob(f"omni-{rid}-*")]
    assert not leaked, f"server left shared memory behind: {leaked}"


def _run_ids(pid: int) -> set[str]:
    """Run ids of the server's workers (`omni_server.runtime.worker DIR RUN_ID ...`), which
    name its /dev/shm segments `omni-RUN_ID-*`."""
    ids = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            argv = Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")
            if "omni_server.runtime.worker" in argv:
                ids.add(argv[argv.index("omni_server.runtime.worker") + 2])
    return ids


def _tail(tmp_path: Path) -> str:
    return (tmp_path / "server.log").read_text(errors="replace")[-3000:]


@pytest.mark.timeout(300)
def test_speech_bench_against_a_real_server(server, tmp_path):
    out = tmp_path / "bench"
    code = "import sys; from omni_bench.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, "speech", "--url", server, "--concurrency", "1,2",
         "--requests", "4", "--stream", "--format", "pcm", "--peer", "in-process", "--wer",
         "--warmup", "1", "--seed", "7", "--out", str(out)],
        capture_output=True, text=True, timeout=240, env=os.environ | {"TQDM_DISABLE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    result = json.loads((out / "speech.json").read_text())
    ours, floor = result["targets"]
    assert (ours["name"], floor["name"]) == ("omni-server", "in-process")
    for target in (ours, floor):
        assert [x["concurrency"] for x in target["levels"]] == [1, 2]
        for level in target["levels"]:
            assert level["requests"] == 4 and level["failed"] == 0
            assert level["audio_seconds_per_second"] > 0
            assert 0 < level["ttfa"]["p50"] <= level["latency"]["p50"]
        # The served voice must be intelligible, not merely non-empty.
        assert target["wer"]["clips"] == 4
        assert target["wer"]["corpus_wer"] < 0.25, target["wer"]["worst"]
    # Seeded: the served audio is the in-process audio, so Whisper hears exactly the same.
    assert ours["wer"]["corpus_wer"] == floor["wer"]["corpus_wer"]
    assert "| omni-server | 1 |" in (out / "speech.md").read_text()
    for png in ("ttfa.png", "throughput.png"):
        assert (out / png).stat().st_size > 1000
