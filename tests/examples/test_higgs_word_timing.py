"""examples/higgs-audio-v2 with its word_timing stage, served on a tiny random checkpoint
through the runtime's real processes (CPU): the audio passes through unchanged (byte for byte
what the vocoder sends when it is the terminal stage itself), and the chunks' timings joined
are the request's text with every word timed, in order, inside the audio.

The random model's audio is no speech, so this proves the wiring and the contract, not the
times; tests/audio/test_forced_alignment.py measures those on the embedded voice.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omni_server.audio import decode
from omni_server.audio.align_text import spoken_words
from omni_server.contracts import SpeechOptions, SpeechTiming, speech_payload
from tests.helpers.server import ROOT

REPO = ROOT / "examples" / "higgs-audio-v2"
MODEL = "higgs-audio-v2"
TEXT = "It may not be a holiday, but it's the best day of the year. Hooray!"


@pytest.fixture(scope="module", autouse=True)
def on_the_cpu() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        yield


@pytest.fixture(scope="module")
def undeclared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example as a repository that does not declare word_timing: no folder, the vocoder
    terminal (vocoder/stage.toml's comment says how)."""
    repo = tmp_path_factory.mktemp("repo") / REPO.name
    shutil.copytree(REPO, repo, ignore=shutil.ignore_patterns("__pycache__", "word_timing"))
    toml = repo / "vocoder" / "stage.toml"
    text = toml.read_text()
    for old, new in (('stream_to = ["word_timing"]', "terminal = true"),
                     ("stream_samples = true", "stream_samples = false")):  # fmt: skip
        assert old in text
        text = text.replace(old, new)
    toml.write_text(text)
    return repo


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_bench.random_checkpoint import write_higgs_audio_v2

    folder = tmp_path_factory.mktemp("ckpt")
    return write_higgs_audio_v2(folder / "higgs", "tiny", seed=0, audio_eos_scale=0.6)


async def spoken(
    repo: Path, checkpoint: Path, timing: bool = True
) -> tuple[list[dict[str, Any]], Any]:
    from omni_server.compiler import compile_repository
    from tests.helpers.runtime import running

    plan = compile_repository(repo, ["--parameters.checkpoint", str(checkpoint)])
    options = SpeechOptions("higgs", response_format="pcm", temperature=1.0, seed=3, timing=timing)
    payload = speech_payload(TEXT, options)
    async with running(plan) as runtime, runtime.submit(plan.models[MODEL], payload) as handle:
        chunks = [chunk async for chunk in handle]
        result = await handle.result()
    return chunks, result


def test_the_example_resolves_with_word_timing_after_the_vocoder(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`omni-server config resolve`: word_timing is the model's terminal stage, fed by the
    vocoder's stream (which sends its samples), in the vocoder's process, on the CPU."""
    from omni_server.cli import main

    argv = ["config", "resolve", "--repo", str(REPO), "--parameters.checkpoint", "/models/higgs",
            "--show", "config", "--format", "json"]  # fmt: skip
    assert main(argv) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert stages["vocoder"]["stream_to"] == ["word_timing"]
    assert stages["vocoder"]["parameters"]["stream_samples"] is True
    assert not stages["vocoder"].get("terminal")
    timing = stages["word_timing"]
    assert timing["terminal"] is True and timing["process"] == "vocoder"
    assert timing["scheduler"]["kind"] == "ar"


@pytest.mark.slow
async def test_word_timing_passes_the_audio_and_times_every_word(
    checkpoint: Path, undeclared: Path
) -> None:
    timed, result = await spoken(REPO, checkpoint)
    plain, plain_result = await spoken(undeclared, checkpoint)
    # a caller that shows no timing (SpeechOptions.timing false) pays no alignment
    untimed, untimed_result = await spoken(REPO, checkpoint, timing=False)
    body = b"".join(c["audio"] for c in timed)
    assert body == b"".join(c["audio"] for c in plain) and body
    assert body == b"".join(c["audio"] for c in untimed)
    assert result == plain_result == untimed_result
    assert all(SpeechTiming.KEY not in c for c in (*plain, *untimed))
    timing = SpeechTiming.joined([c[SpeechTiming.KEY] for c in timed if SpeechTiming.KEY in c])
    assert timing.text == TEXT
    assert [w.text for w in timing.words] == [w.text for w in spoken_words(TEXT)]
    seconds = len(decode(body, "pcm").samples) / 24000
    starts = [w.start_s for w in timing.words]
    assert starts == sorted(starts)
    assert all(0 <= w.start_s <= w.end_s <= seconds + 1e-6 for w in timing.words)
