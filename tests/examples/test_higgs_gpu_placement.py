"""examples/higgs-audio-v2 on a machine with a GPU places itself there with no override: the
audio encoder, the engine (bf16, its decode graphs) and the vocoder on cuda:0, their three
processes under MPS (`mps = "auto"`: a warning and no MPS where it cannot start), and serves.
The GPU tier (docs/gpu.md); the same resolution without a GPU is tests/compiler/test_devices.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from omni_server.audio import decode
from tests.helpers.server import ROOT, ServerProcess

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

REPO = ROOT / "examples" / "higgs-audio-v2"


def _resolve(*overrides: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "omni_server", "config", "resolve", "--repo", str(REPO),
         "--show", "topology", *overrides],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_example_resolves_to_the_gpu_here() -> None:
    devices = _resolve().split("# devices:", 1)[1].splitlines()
    assert "[on_gpu] of repository.toml applied" in devices[0]
    engine = next(line for line in devices if line.startswith("tts_engine"))
    assert engine.startswith('tts_engine    : cuda:0 bfloat16  (device = "auto": ')
    for stage in ("audio_encoder", "vocoder"):
        line = next(line for line in devices if line.startswith(stage))
        assert ': cuda:0  (device = "auto"' in line, line
    # every choice stays overridable
    assert "tts_engine    : cpu float32" in _resolve("--stages.tts_engine.device", "cpu")


def test_the_example_serves_on_the_gpu_with_no_override(tmp_path: Path) -> None:
    from omni_bench.random_checkpoint import write_higgs_audio_v2

    # serving needs no torchaudio (our own tokenizer): no stand-in on the path
    checkpoint = write_higgs_audio_v2(tmp_path / "higgs", "tiny", seed=5)
    server = ServerProcess.start(
        REPO, tmp_path / "server.log", "--parameters.checkpoint", str(checkpoint),
        "--stages.tts_engine.parameters.max_audio_seconds", "2",
    )  # fmt: skip
    with server:
        body = {"model": "tts-1", "voice": "alloy", "input": "Hello there.", "seed": 1}
        body |= {"response_format": "wav", "stream": False}
        request = urllib.request.Request(
            server.url + "/v1/audio/speech",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            clip = decode(response.read(), "wav")
        assert clip.sample_rate == 24000 and clip.seconds > 0
        log = server.log()
        assert "tts_engine: " in log and "decode graphs captured" in log  # graphs: a GPU engine
        assert "MPS control daemon" in log or "mps = auto: MPS cannot start" in log
