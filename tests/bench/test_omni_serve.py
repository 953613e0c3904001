"""`omni-bench omni-serve`: Qwen3-Omni served over HTTP, chat with text and audio out, closed
loop. Its GPU server command line is a valid override of the example repository (as `omni-server
config resolve` compiles it; nothing starts), and a short run against a real server on a tiny
random checkpoint reports every level with its audio (slow: a real server of four processes)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import wave

import pytest

from omni_bench import omni_serve
from tests.helpers.server import ROOT

REPO = ROOT / omni_serve.REPO


def test_the_gpu_command_line_holds_the_example_to_the_gpu(tmp_path):
    args = omni_serve.build_parser().parse_args(
        ["--repo", str(REPO), "--checkpoint", str(tmp_path), "--gpu"]
    )
    args.levels = [1, 16, 64]
    overrides = omni_serve.serve_args(args)
    i = overrides.index("--max-in-flight")  # a server option, not a config override
    assert overrides[i + 1] == "128"
    del overrides[i : i + 2]
    out = subprocess.run(
        [sys.executable, "-m", "omni_server", "config", "resolve", "--repo", str(REPO),
         "--show", "config", "--format", "json", *overrides],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    config = json.loads(out.stdout)
    stages = config["stages"]
    for name in ("audio_encoder", "thinker", "talker", "code2wav"):
        assert stages[name]["gpu"] == [0], name
    thinker, talker = stages["thinker"], stages["talker"]
    assert thinker["engine"]["dtype"] == "bfloat16"  # the example's [on_gpu], not the bench's
    assert thinker["engine"]["max_batch_size"] == talker["engine"]["max_batch_size"] == 64
    assert thinker["engine"]["max_total_tokens"] == 16384  # 64 x (128 + 64) x 1.25
    assert thinker["parameters"]["ignore_eos"] is talker["parameters"]["ignore_eos"] is True
    assert talker["parameters"]["max_audio_seconds"] == 6.0
    assert config["parameters"]["checkpoint"] == str(tmp_path)


def test_on_the_cpu_small_levels_keep_the_example_s_batch_and_kv(tmp_path):
    args = omni_serve.build_parser().parse_args(
        ["--repo", str(REPO), "--checkpoint", str(tmp_path), "--concurrency", "1,2"]
    )
    args.levels = [1, 2]
    overrides = omni_serve.serve_args(args)
    assert not any("max_batch_size" in o or "max_total_tokens" in o for o in overrides)
    assert overrides[overrides.index("--stages.thinker.device") + 1] == "cpu"


def test_the_spoken_question_is_a_short_16_khz_wav():
    with wave.open(io.BytesIO(omni_serve.spoken_clip(2.0)), "rb") as w:
        assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (16_000, 1, 32_000)
    assert omni_serve.spoken_clip(2.0) == omni_serve.spoken_clip(2.0)  # the same every run
    asked = omni_serve.questions(6)
    assert [q.spoken for q in asked] == [False, True] * 3


@pytest.mark.parametrize(
    "argv", [["--concurrency", "0"], ["--concurrency", "a"], ["--audio-seconds", "0"]]
)
def test_bad_levels_exit_2_before_anything_is_written(tmp_path, argv):
    assert omni_serve.main(["--checkpoint", str(tmp_path / "ckpt"), *argv]) == 2
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow  # a tiny random checkpoint written, then served by four processes: ~1-2 min
@pytest.mark.timeout(600)
def test_a_short_run_reports_text_and_audio_per_level(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from omni_bench.cli import main; sys.exit(main())",
         "omni-serve", "--repo", str(REPO), "--checkpoint", str(tmp_path / "ckpt"),
         "--size", "tiny", "--concurrency", "1,2", "--max-tokens", "6", "--audio-seconds", "1",
         "--min-requests", "2", "--warmup", "0", "--out", str(out)],
        capture_output=True, text=True, timeout=580, env=os.environ | {"TQDM_DISABLE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((out / "omni_serve.json").read_text())
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 2] and not result["leftovers"]
    for lv in result["levels"]:
        assert lv["failed"] == 0 and lv["requests"] == max(2, 2 * lv["concurrency"])
        assert lv["ttft"]["p50"] > 0 and 0 < lv["first_audio"]["p50"] <= lv["first_audio"]["p95"]
        assert lv["audio_seconds_per_second"] > 0 and lv["rtf"]["p50"] > 0
        spoken = [a["spoken"] for a in lv["answers"]]
        assert True in spoken and False in spoken  # written and spoken questions both
        assert lv["by_question"]["spoken"]["first_audio"]["p50"] > 0
        for answer in lv["answers"]:
            # ignore_eos: every answer is --max-tokens tokens and --audio-seconds of speech (the
            # codec's last frame less its 555 lookahead samples, as one whole decode)
            assert answer["completion_tokens"] == 6 and answer["finish_reason"] == "length"
            assert answer["audio_seconds"] == pytest.approx(1.0, abs=0.1)
    table = (out / "omni_serve.md").read_text()
    assert "| concurrency | requests | failed | TTFT p50 ms | TTFT p95 ms |" in table
    assert "| 2 | 4 | 0 |" in table
    assert "| first audio p50 at c=1 | <= 250 ms |" in table  # the targets, met or missed
    assert "not run (no c=64)" in table
    assert "omni-server ready" in (out / "server.log").read_text()
