"""`omni-bench chat-serve`: the thinker served over HTTP, closed loop. Its server command line
is a valid override of the embedded repository (the GPU placement as `omni-server config
resolve` compiles it; nothing starts), and a short run against a real server on a tiny random
Llama checkpoint reports every level's fields (slow: a real server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from omni_bench import chat_serve
from tests.helpers.server import ROOT

REPO = ROOT / chat_serve.REPO


def test_the_gpu_command_line_resolves_to_the_thinker_on_the_gpu(tmp_path):
    args = chat_serve.build_parser().parse_args(["--checkpoint", str(tmp_path), "--gpu"])
    args.levels = [1, 16, 64]
    overrides = chat_serve.serve_args(args)
    i = overrides.index("--model-control-mode")  # server options, not config overrides
    assert overrides[i : i + 6] == [
        "--model-control-mode", "explicit", "--load-model", "smol-chat", "--max-in-flight", "128"
    ]  # fmt: skip
    del overrides[i : i + 6]
    out = subprocess.run(
        [sys.executable, "-m", "omni_server", "config", "resolve", "--repo", str(REPO),
         "--show", "config", "--format", "json", *overrides],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    thinker = json.loads(out.stdout)["stages"]["thinker"]
    assert thinker["gpu"] == [0] and thinker["engine"]["dtype"] == "bfloat16"
    assert thinker["engine"]["max_batch_size"] == 64  # the largest level steps in one batch
    assert thinker["parameters"]["checkpoint"] == str(tmp_path)
    assert thinker["parameters"]["ignore_eos"] is True


@pytest.mark.parametrize(
    "argv", [["--concurrency", "0"], ["--concurrency", "a"], ["--max-tokens", "1"]]
)
def test_bad_levels_exit_2_before_anything_is_written(tmp_path, argv):
    assert chat_serve.main(["--checkpoint", str(tmp_path / "ckpt"), *argv]) == 2
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow  # a real server on a tiny random Llama checkpoint: ~20 s on this machine
@pytest.mark.timeout(300)
def test_a_short_run_reports_ttft_and_tokens_per_level(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from omni_bench.cli import main; sys.exit(main())",
         "chat-serve", "--repo", str(REPO), "--checkpoint", str(tmp_path / "ckpt"),
         "--size", "tiny", "--concurrency", "1,4", "--max-tokens", "6", "--min-requests", "4",
         "--out", str(out)],
        capture_output=True, text=True, timeout=280, env=os.environ | {"TQDM_DISABLE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((out / "chat_serve.json").read_text())
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 4] and not result["leftovers"]
    for lv in result["levels"]:
        assert lv["failed"] == 0 and lv["requests"] == max(4, 2 * lv["concurrency"])
        assert 0 < lv["ttft"]["p50"] <= lv["ttft"]["p95"]
        assert lv["decode_tokens_per_s"]["p50"] > 0
        # ignore_eos: every answer decoded exactly --max-tokens tokens
        assert lv["tokens_per_s"] * lv["wall_seconds"] == pytest.approx(6 * lv["requests"])
    table = (out / "chat_serve.md").read_text()
    assert "| concurrency | requests | failed | TTFT p50 ms | TTFT p95 ms |" in table
    assert "| 4 | 8 | 0 |" in table
