"""The harness end to end: a real `omni_server` process on the embedded repository, driven by
`omni-bench speech` for a few seeded, streamed requests, with the in-process peer and WER."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.server import EMBEDDED_REPO, ServerProcess

pytestmark = pytest.mark.slow  # a real server and the whole bench


@pytest.fixture
def server(embedded_server: ServerProcess) -> str:
    """The URL of the suite's embedded server (tests/conftest.py), whose teardown checks that it
    exits 0 on SIGTERM leaving no process or segment."""
    assert embedded_server.run_ids(), "found no worker process of the server"
    return embedded_server.url


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


@pytest.mark.timeout(300)
def test_serve_starts_the_server_measures_it_and_stops_it(tmp_path):
    out = tmp_path / "bench"
    code = "import sys; from omni_bench.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, "speech", "--serve", "--repo", str(EMBEDDED_REPO),
         "--concurrency", "1", "--requests", "2", "--warmup", "1", "--format", "pcm",
         "--out", str(out)],
        capture_output=True, text=True, timeout=280, env=os.environ | {"TQDM_DISABLE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((out / "speech.json").read_text())
    assert result["settings"]["served_repository"] == str(EMBEDDED_REPO)
    [ours] = result["targets"]
    [level] = ours["levels"]
    assert level["requests"] == 2 and level["failed"] == 0
    cpu = level["cpu"]
    assert cpu["server"]["total"] > 0, "the started server's CPU is reported as its own"
    assert any(name.startswith("worker") for name in cpu["server"]["processes"])
    assert not any(name.startswith("worker") for name in cpu["bench"]["processes"])
    port = result["settings"]["url"].rsplit(":", 1)[1]
    left = [p for p in Path("/proc").glob("[0-9]*") if f"--port\0{port}\0" in _cmdline(p)]
    assert not left, "the server the bench started outlived it"


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""
