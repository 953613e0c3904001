"""`omni-bench higgs-serve`'s server command lines are valid overrides of the example
repository: the example's own GPU placement (docs/models.md), and the replicated `pipeline`
under MPS with shared weights (and `3v`: with the vocoder in each replica), as `omni-server
config resolve` compiles them (nothing starts; the served run
itself is a device benchmark, run on the CPU by hand with the tiny checkpoint)."""

from __future__ import annotations

import json
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


@pytest.mark.parametrize("layout", ["1", "1v", "3", "3v", "1m", "1mef4"])
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
    # 3v: each replica decodes its own frames (a replicated vocoder process could not share)
    assert config["stages"]["vocoder"]["process"] == ("pipeline" if vocoders else "vocoder")


def test_without_gpu_every_stage_runs_on_the_cpu(tmp_path):
    config = _resolved(["--checkpoint", str(tmp_path), "--replicas", "3"])
    assert all("gpu" not in stage for stage in config["stages"].values())
    assert config["stages"]["tts_engine"]["engine"]["dtype"] == "float32"
    assert config["server"]["mps"] == "off" and config["server"]["weight_share"] == "on"


@pytest.mark.parametrize("layout", ["0", "0v", "x", "3w", "1vv", "1f", "1f4v"])
def test_a_layout_is_a_count_and_its_flags(layout):
    with pytest.raises(ValueError):
        higgs_serve.parse_layout(layout)
