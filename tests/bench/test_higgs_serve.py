"""`omni-bench higgs-serve`'s server command lines are valid overrides of the example
repository: the example's own GPU placement (docs/models.md), and the replicated `pipeline`
under MPS with shared weights (and `3v`: with the vocoder in each replica), as `omni-server
config resolve` compiles them (nothing starts; the served run
itself is a device benchmark, run on the CPU by hand with the tiny checkpoint)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from omni_bench import higgs_serve
from tests.helpers.server import ROOT

REPO = ROOT / higgs_serve.REPO


def _overrides(argv: list[str]) -> list[str]:
    args = higgs_serve.build_parser().parse_args(["--repo", str(REPO), *argv])
    args.levels = [1, 64]
    overrides = higgs_serve.serve_args(args, args.replicas)
    i = overrides.index("--max-in-flight")  # a server option, not a config override
    assert overrides[i + 1] == "128"
    del overrides[i : i + 2]
    return overrides


def _resolved(argv: list[str]) -> dict:
    overrides = _overrides(argv)
    out = subprocess.run(
        [sys.executable, "-m", "omni_server", "config", "resolve", "--repo",
         str(REPO), "--show", "config", "--format", "json", *overrides],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# two replicas, not the bench's three: `config resolve` bounds a process's replicas by this
# machine's cores (placement.check_machine), two on CI
@pytest.mark.parametrize("layout", ["1", "1v", "2", "2v", "1m", "1mef4"])
def test_the_gpu_placement_resolves(tmp_path, layout):
    """--gpu: the example's own GPU placement (its [on_gpu]), held to the GPU even on this
    machine without one, with no override of what the example declares there."""
    replicas, vocoders, mps, eager, first = higgs_serve.parse_layout(layout)
    args = ["--checkpoint", str(tmp_path), "--gpu", "--replicas", layout]
    overrides = _overrides(args)
    for declared in ("dtype", "bfloat16", "cuda_graphs true", "audio_encoder.gpu "):
        assert declared not in " ".join(overrides)  # the example's, not the bench's
    config = _resolved(args)
    engine = config["stages"]["tts_engine"]
    assert engine["gpu"] == [0] and engine["engine"]["dtype"] == "bfloat16"
    assert engine["engine"]["max_total_tokens"] == 65536  # the same KV for every count
    assert engine["gpu_memory_fraction"] == pytest.approx(0.55 / replicas, abs=1e-3)
    assert config["stages"]["vocoder"]["gpu"] == [0]
    assert config["stages"]["audio_encoder"]["gpu"] == [0]
    assert config["stages"]["tts_engine"]["parameters"]["ignore_eos"] is True
    assert config["parameters"]["checkpoint"] == str(tmp_path)
    pipeline = config["processes"]["pipeline"]
    assert pipeline["num_replicas"] == replicas
    if replicas > 1:
        assert pipeline["replica_devices"] == [0] * replicas
        assert config["server"]["weight_share"] == "on"
    assert config["server"]["mps"] == ("on" if mps else "auto")  # "auto": the example's
    assert mps == (replicas > 1 or "m" in layout)
    vocoder = config["stages"]["vocoder"]["parameters"]
    assert vocoder.get("cuda_graphs", True) is not eager
    assert vocoder.get("first_lookahead_frames") == first
    # 2v: each replica decodes its own frames (a replicated vocoder process could not share)
    assert config["stages"]["vocoder"]["process"] == ("pipeline" if vocoders else "vocoder")


def test_without_gpu_every_stage_runs_on_the_cpu(tmp_path):
    config = _resolved(["--checkpoint", str(tmp_path), "--replicas", "2"])
    assert all("gpu" not in stage for stage in config["stages"].values())
    assert config["stages"]["tts_engine"]["engine"]["dtype"] == "float32"
    assert config["server"]["mps"] == "off" and config["server"]["weight_share"] == "on"


@pytest.mark.parametrize("layout", ["0", "0v", "x", "3w", "1vv", "1f", "1f4v"])
def test_a_layout_is_a_count_and_its_flags(layout):
    with pytest.raises(ValueError):
        higgs_serve.parse_layout(layout)


def test_open_loop_admission_covers_every_request_it_sends(tmp_path):
    args = higgs_serve.build_parser().parse_args(
        ["--checkpoint", str(tmp_path), "--concurrency", "", "--rate", "5,20", "--duration", "20"]
    )
    args.levels = []
    assert args.rates == [5.0, 20.0]
    assert higgs_serve.open_loop_requests(args, 20.0) == 400
    assert higgs_serve.max_in_flight(args) == 400  # every request may be in flight at once


@pytest.mark.parametrize("rate", ["0", "5,x", "inf"])
def test_a_bad_rate_is_a_usage_error(tmp_path, rate):
    with pytest.raises(SystemExit) as exit_:
        higgs_serve.main(["--checkpoint", str(tmp_path), "--rate", rate])
    assert exit_.value.code == 2


@pytest.mark.parametrize("argv", [["--concurrency", ""], ["--rate", "5", "--duration", "0"]])
def test_no_level_or_no_duration_exits_2_before_writing_a_checkpoint(tmp_path, argv):
    assert higgs_serve.main(["--checkpoint", str(tmp_path), *argv]) == 2
    assert not (tmp_path / "config.json").exists()


@pytest.mark.slow  # a real server on a tiny random checkpoint: ~10 s on this machine
@pytest.mark.timeout(300)
def test_open_loop_mode_serves_a_tiny_checkpoint_and_reports_each_rate(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from omni_bench.cli import main; sys.exit(main())",
         "higgs-serve", "--repo", str(REPO), "--checkpoint", str(tmp_path / "ckpt"),
         "--size", "tiny", "--concurrency", "", "--rate", "4", "--duration", "2",
         "--min-requests", "4", "--replicas", "1", "--audio-seconds", "0.5", "--out", str(out)],
        capture_output=True, text=True, timeout=280, env=os.environ | {"TQDM_DISABLE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [run] = json.loads((out / "higgs_serve.json").read_text())
    [level] = run["levels"]
    assert level["rate"] == 4 and level["requests"] == 8 and level["failed"] == 0
    assert 0 < level["ttfa"]["p50"] <= level["ttfa"]["p95"]
    assert 0 <= level["underrun_share"] <= 1
    assert level["audio_seconds_per_second"] > 0 and level["requests_per_second"] > 0
    assert not run["leftovers"]
    table = (out / "higgs_serve.md").read_text()
    assert "| replicas | rate req/s | requests | failed | TTFA p50 ms | TTFA p95 ms |" in table
    assert "| 1 | 4 | 8 | 0 |" in table
    assert "| concurrency |" not in table  # no closed-loop level was asked for
