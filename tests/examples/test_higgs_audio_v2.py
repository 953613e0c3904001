"""examples/higgs-audio-v2 served end to end on tiny random checkpoints (the writer's, in this
module's tmp dir: seeds 0 and 5 with `--audio-eos-scale 0.6`, so greedy generations run to the
150-frame cap, not ~10-40; at 0.7 the cloned voice's ends after ~20 frames on several seeds,
and tests/engine/test_higgs_audio.py covers endings), against transformers' reference
(tests/examples/reference_higgs.py):

- greedy, on both seeds through the runtime and on seed 0 over HTTP: the frames the engine
  emits equal `HiggsAudioV2ForConditionalGeneration.generate(do_sample=False)` for the same
  text, voice and instructions (the reference processor builds its prompt and encodes the
  voice's clip), each comparison at least MIN_COMPARED frames long and the counts reported
  (`record_property` "frames_compared"); then the served waveform matches the processor's
  decode of those frames (all at once) at >= 30 dB SNR, streamed and whole (over HTTP the
  frames are not visible: their count is the audio's length, checked first);
- seeded sampling reproducible and independent of the batch: 8 concurrent requests of
  different lengths each equal their run alone;
- a cloned voice's encoder runs once; an unknown voice is a 400 naming the voices; the six
  formats, speed, /v1/models; abort mid-stream frees the request's KV and stops the vocoder;
- custom voices (POST /v1/audio/voices, a clip of the embedded Piper voice): spoken with the
  `openai` client, the audio equals the reference's for the stored clip and its transcript;
  the encoder runs once per voice; a voice whose clip vanished mid-request (a DELETE racing
  it) fails that request with a 400, a deleted one is the 400 naming the voices;
- the voices are the compiled plan's: the server runs a copy of the example with one more
  clip in voices/ that only a command-line `--models.higgs-audio-v2.voices` lists;
- bad input: empty input, an unsupported format, a prompt over the context (400), and at start
  (exit 1, one line naming the folder): no checkpoint, a missing folder, another model_type,
  a config whose shapes disagree with the weights.

Real processes throughout (the runtime's, or `omni-server`), and serving needs neither
transformers nor torchaudio: every server and stage process here runs where importing either
raises (a `sys.meta_path` blocker in a sitecustomize on PYTHONPATH; the test of the blocker
shows it was loaded in each of them), so the six formats, the cloned voice `joe` and every
other served test run on our own tokenizer.

Stand-in, labelled: this machine has no torchaudio wheel for its torch, and transformers (the
reference) will not build the audio tokenizer without it; the reference sees
`torchaudio_stand_in(..., resample_like_torchaudio=True)` (omni_bench.random_checkpoint),
whose resample (24 -> 16 kHz for the semantic encoder of a clip) is the served tokenizer's own
re-implementation of torchaudio's algorithm, so the clip's codes agree; with a real torchaudio
it is not used (the function against the real one: tools/device/higgs_tokenizer_check.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omni_server.audio import decode
from omni_server.contracts import SpeechOptions, speech_payload
from tests.helpers.metrics import samples, value
from tests.helpers.server import ROOT, ServerProcess

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

REPO = ROOT / "examples" / "higgs-audio-v2"
MODEL = "higgs-audio-v2"
SYSTEM = "Generate audio following instruction."
SCENE = "Audio is recorded from a quiet room."
CLONED = "joe"
TEXTS = [
    "The sun rises in the east.",
    "Hello there, how are you doing on this fine day?",
    "It may not be a holiday, but it's the best day of the year. Hooray!",
]
MIN_SNR_DB = 30.0
SEEDS = (0, 5)  # the served equality's checkpoints; the HTTP server's is the first
AUDIO_EOS_SCALE = 0.6  # random_checkpoint --audio-eos-scale: long greedy generations
MIN_COMPARED = 48  # every greedy comparison with transformers covers at least this many frames
MAX_FRAMES = 150  # both sides stop there (6 s of audio at 25 frames a second)
# the reference's greedy: ras_win_len=None, max_new_tokens=MAX_FRAMES
GREEDY = ["--stages.tts_engine.parameters.ras_window", "0",
          "--stages.tts_engine.parameters.max_audio_seconds", str(MAX_FRAMES / 25)]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def on_the_cpu() -> Iterator[None]:
    """The example places itself on a GPU where there is one (bf16); these tests compare its
    fp32 CPU run with the reference, so every server and compile here sees no GPU
    (test_higgs_gpu_placement.py serves it on the GPU)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        yield


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    from omni_bench.random_checkpoint import write_higgs_audio_v2

    folder = tmp_path_factory.mktemp("ckpt")
    return {
        seed: write_higgs_audio_v2(
            folder / f"higgs-{seed}", "tiny", seed=seed, audio_eos_scale=AUDIO_EOS_SCALE
        )
        for seed in SEEDS
    }


@pytest.fixture(scope="module")
def checkpoint(checkpoints: dict[int, Path]) -> Path:
    return checkpoints[SEEDS[0]]


def report_compared(record_property: Any, counts: list[int]) -> None:
    """Says how many frames each greedy comparison covered (junit property, and -s / -rP), and
    fails one that could pass on the delay pattern's opening alone."""
    record_property("frames_compared", counts)
    print(f"frames compared with transformers: {counts} ({sum(counts)} in all)")
    assert min(counts) >= MIN_COMPARED, f"frames compared {counts}: under {MIN_COMPARED}"


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The reference's torchaudio, where there is none (the reference only: serving needs none)."""
    from omni_bench.random_checkpoint import has_torchaudio, torchaudio_stand_in

    if has_torchaudio():
        return []
    folder = tmp_path_factory.mktemp("ta")
    return [str(torchaudio_stand_in(folder, resample_like_torchaudio=True))]


BLOCKER = """\
# Test blocker (tests/examples/test_higgs_audio_v2.py): this interpreter cannot import
# transformers or torchaudio; it notes its pid and command line in processes.log beside it.
import os, sys
BLOCKED = ("transformers", "torchaudio")
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked here: serving must not need it")
        return None
sys.meta_path.insert(0, _Blocked())
with open("/proc/self/cmdline", "rb") as _f:
    _cmd = _f.read().replace(b"\\0", b" ").decode(errors="replace")
with open(os.path.join(os.path.dirname(__file__), "processes.log"), "a") as _f:
    _f.write(f"{os.getpid()} {_cmd}\\n")
"""


@pytest.fixture(scope="module")
def no_transformers(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """PYTHONPATH entries under which importing transformers or torchaudio raises."""
    folder = tmp_path_factory.mktemp("blocker")
    (folder / "sitecustomize.py").write_text(BLOCKER)
    return [str(folder)]


def blocked_pids(no_transformers: list[str]) -> set[int]:
    """The processes that started under the blocker so far."""
    log = Path(no_transformers[0]) / "processes.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return {int(line.split()[0]) for line in lines}


@contextlib.contextmanager
def python_path(paths: list[str]) -> Iterator[None]:
    """Processes started inside see `paths` first (the stand-in); restored after."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [before])])
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def conversation(
    text: str, voice: str | None, system: str = SYSTEM, transcript: str | None = None
) -> list[dict[str, Any]]:
    """The reference's TTS conversation, as the pipeline's preprocessing documents it: a voice
    of voices/ by name, or a custom voice's `transcript`."""

    def turn(role: str, value: str) -> dict[str, Any]:
        return {"role": role, "content": [{"type": "text", "text": value}]}

    messages = [turn("system", system), turn("scene", SCENE)]
    if voice is not None and transcript is None:
        transcript = (REPO / "voices" / f"{voice}.txt").read_text().strip()
    if transcript is not None:
        messages += [
            turn("user", transcript),
            {"role": "assistant", "content": [{"type": "audio", "url": "voice"}]},
        ]
    return [*messages, turn("user", text)]


# the added voice's clips: what each says (the custom one is POSTed, the extra one sits in the
# server's voices/ and only the command line lists it)
CLIPS = {
    "custom": "Custom voices are cloned from a short clip.",
    "extra": "This voice is listed on the command line.",
}
EXTRA = "ada"
VOICES = ["higgs", CLONED, EXTRA]  # the override's list
CUSTOM_TEXT = TEXTS[0]  # spoken in the custom voice: CASES[0] says it in the model's own

CASES = [
    (TEXTS[0], "higgs", None),
    (TEXTS[1], CLONED, None),
    (TEXTS[2], "higgs", "Speak slowly and warmly."),
]


@pytest.fixture(scope="module")
def piper_clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Clips of the embedded Piper voice at 24 kHz, as voices/joe.wav is, with their transcripts:
    one a user adds with POST, one a voices/ clip that only an override lists."""
    from omni_bench.inprocess import InProcessVoice

    piper = InProcessVoice(ROOT / "repository")
    folder = tmp_path_factory.mktemp("clips")
    clips = {}
    for name, transcript in CLIPS.items():
        path = folder / f"{name}.wav"
        speech = piper.speak(transcript, response_format="wav", sample_rate=24000, seed=1)
        path.write_bytes(speech.body)
        clips[name] = (path, transcript)
    return clips


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("state") / "omni-server"  # the server makes it, 0700


@pytest.fixture(scope="module")
def custom_voice(
    higgs_server: ServerProcess, piper_clips: dict[str, tuple[Path, str]], data_dir: Path
) -> dict[str, Any]:
    """A voice added with POST /v1/audio/voices: its entry, with the clip the server stored."""
    clip, transcript = piper_clips["custom"]
    entry = post_voice(higgs_server, clip, transcript)
    return {**entry, "clip": data_dir / "voices" / f"{entry['id']}.wav", "transcript": transcript}


def post_voice(server: ServerProcess, clip: Path, transcript: str) -> dict[str, Any]:
    import httpx2

    answer = httpx2.post(
        server.url + "/v1/audio/voices",
        data={"model": MODEL, "name": "Piper", "transcript": transcript},
        files={"file": (clip.name, clip.read_bytes(), "audio/wav")},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    entry: dict[str, Any] = answer.json()
    return entry


def reference_cases() -> list[dict[str, Any]]:
    """CASES as reference_higgs.py takes them."""
    return [
        {
            "conversation": conversation(
                text, None if voice == "higgs" else voice, system or SYSTEM
            ),
            "clip": None if voice == "higgs" else str(REPO / "voices" / f"{voice}.wav"),
        }
        for text, voice, system in CASES
    ]


@pytest.fixture(scope="module")
def references(
    checkpoint: Path,
    stand_in: list[str],
    custom_voice: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> list[dict[str, Any]]:
    """transformers' frames and waveform on the first seed for each of CASES, then for the
    custom voice's stored clip and transcript (one child process)."""
    custom = {
        "conversation": conversation(
            CUSTOM_TEXT, custom_voice["id"], transcript=custom_voice["transcript"]
        ),
        "clip": str(custom_voice["clip"]),
    }
    return run_reference(checkpoint, stand_in, [*reference_cases(), custom], tmp_path_factory)


def run_reference(
    checkpoint: Path,
    stand_in: list[str],
    cases: list[dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> list[dict[str, Any]]:
    """reference_higgs.py on `cases` in a child process that sees the stand-in."""
    folder = tmp_path_factory.mktemp("reference")
    (folder / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*stand_in, *sys.path])}
    run = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("reference_higgs.py")), str(checkpoint),
         str(folder / "cases.json"), str(folder / "out.json"), str(MAX_FRAMES)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out: list[dict[str, Any]] = json.loads((folder / "out.json").read_text())
    return out


@pytest.fixture(scope="module")
def reference(references: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return references[: len(CASES)]


@pytest.fixture(scope="module")
def greedy_references(
    checkpoints: dict[int, Path],
    stand_in: list[str],
    reference: list[dict[str, Any]],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[int, list[dict[str, Any]]]:
    """CASES' reference on every seed (the first seed's from `reference`)."""
    out = {SEEDS[0]: reference}
    for seed in SEEDS[1:]:
        out[seed] = run_reference(checkpoints[seed], stand_in, reference_cases(), tmp_path_factory)
    return out


def snr_db(reference: np.ndarray, served: np.ndarray) -> float:
    assert len(served) == len(reference), (len(served), len(reference))
    noise = float(np.sum((reference - served) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(float(np.sum(reference**2)) / noise)


def inputs(text: str, voice: str, **fields: Any) -> dict[str, Any]:
    """The speech endpoint's pipeline inputs (SpeechRequest.pipeline_inputs)."""
    options = {"response_format": "pcm", "stream": True, "temperature": 0.0, **fields}
    return speech_payload(text, SpeechOptions(voice, **options))


async def served(runtime: Any, model: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """One request through the runtime: its body and the vocoder's result."""
    body = bytearray()
    async with runtime.submit(model, fields) as handle:
        async for chunk in handle:
            body += chunk["audio"]
        result = await handle.result()
    return {**result, "body": bytes(body)}


def first_difference(got: list[list[int]], expected: list[list[int]]) -> int | None:
    pairs = zip(got, expected, strict=False)
    return next((n for n, (a, b) in enumerate(pairs) if a != b), None)


def runtime_plan(checkpoint: Path) -> Any:
    from omni_server.compiler import compile_repository

    overrides = ["--parameters.checkpoint", str(checkpoint), *GREEDY,
                 "--stages.vocoder.parameters.return_frames", "true"]  # fmt: skip
    return compile_repository(REPO, overrides)


@pytest.mark.parametrize("seed", SEEDS)
async def test_greedy_frames_then_audio_equal_transformers(
    seed: int,
    checkpoints: dict[int, Path],
    no_transformers: list[str],
    greedy_references: dict[int, list[dict[str, Any]]],
    record_property: Any,
) -> None:
    """Through the runtime's real processes: greedy frames identical to the reference (each
    comparison >= MIN_COMPARED frames), then the streamed
    pcm within 30 dB of the reference's decode of them."""
    from tests.helpers.runtime import running

    reference = greedy_references[seed]
    plan = runtime_plan(checkpoints[seed])
    model = plan.models[MODEL]
    with python_path(no_transformers):
        async with running(plan) as runtime:
            got = [
                await served(runtime, model, inputs(text, voice, instructions=system))
                for text, voice, system in CASES
            ]
    for (text, voice, _), mine, expected in zip(CASES, got, reference, strict=True):
        frames, want = mine["generated"], expected["frames"]
        first = first_difference(frames, want)
        assert frames == want, (text, voice, len(frames), len(want), f"first diff {first}")
        wave = decode(mine["body"], "pcm").samples
        assert mine["frames"] * 960 == len(wave)
        assert snr_db(np.array(expected["audio"], np.float32), wave) >= MIN_SNR_DB
    report_compared(record_property, [len(r["frames"]) for r in reference])
    assert reference[0]["frames"] != reference[2]["frames"]  # instructions matter


async def test_seeded_sampling_reproducible_and_batch_independent(
    checkpoint: Path, no_transformers: list[str]
) -> None:
    """Seeded sampling through the runtime's processes: alone, again, with another seed, and
    as one of 8 concurrent requests of different lengths."""
    from tests.helpers.runtime import running

    plan = runtime_plan(checkpoint)
    model = plan.models[MODEL]
    with python_path(no_transformers):
        async with running(plan) as runtime:
            sampled = [
                inputs(TEXTS[i % 3] * (1 + i % 2), "higgs" if i % 2 else CLONED,
                       temperature=1.0, seed=100 + i)
                for i in range(8)
            ]  # fmt: skip
            alone = [(await served(runtime, model, s))["generated"] for s in sampled]
            again = (await served(runtime, model, sampled[0]))["generated"]
            reseeded = inputs(TEXTS[0], CLONED, temperature=1.0, seed=7)  # sampled[0], seed 7
            other = (await served(runtime, model, reseeded))["generated"]
            together = await asyncio.gather(*(served(runtime, model, s) for s in sampled))
    assert again == alone[0] and other != alone[0]
    assert [r["generated"] for r in together] == alone
    assert len({len(frames) for frames in alone}) > 1


@pytest.fixture(scope="module")
def higgs_server(
    checkpoint: Path,
    no_transformers: list[str],
    piper_clips: dict[str, tuple[Path, str]],
    data_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerProcess]:
    """The example served as shipped, but from a copy whose voices/ holds one more clip
    (EXTRA) that repository.toml does not list: the command line's `voices` does."""
    repo = tmp_path_factory.mktemp("repo") / REPO.name
    shutil.copytree(REPO, repo, ignore=shutil.ignore_patterns("__pycache__"))
    clip, transcript = piper_clips["extra"]
    shutil.copy(clip, repo / "voices" / f"{EXTRA}.wav")
    (repo / "voices" / f"{EXTRA}.txt").write_text(transcript + "\n")
    log = tmp_path_factory.mktemp("server") / "server.log"
    with python_path(no_transformers):
        server = ServerProcess.start(
            repo, log, "--parameters.checkpoint", str(checkpoint), *GREEDY,
            "--data-dir", str(data_dir), f"--models.{MODEL}.voices", ",".join(VOICES),
        )  # fmt: skip
    with server:
        yield server


def speech(server: ServerProcess, **body: Any) -> tuple[int, bytes, dict[str, str]]:
    import urllib.error
    import urllib.request

    payload = {"model": "tts-1", "voice": "alloy", "temperature": 0, **body}
    request = urllib.request.Request(
        server.url + "/v1/audio/speech",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read(), dict(err.headers)


def test_served_audio_matches_the_reference_streamed_and_whole(
    higgs_server: ServerProcess, reference: list[dict[str, Any]], record_property: Any
) -> None:
    """Over HTTP the frames are not visible; their count is the audio's length (960 samples a
    decoded column), equal to the reference's first, then the waveform within 30 dB."""
    from openai import OpenAI

    client = OpenAI(base_url=higgs_server.url + "/v1", api_key="unused")
    for (text, voice, system), expected in zip(CASES, reference, strict=True):
        want = np.array(expected["audio"], np.float32)
        extra = {} if system is None else {"instructions": system}
        streamed = decode(
            client.audio.speech.create(
                model="tts-1", voice=voice, input=text, response_format="pcm",
                extra_body={"temperature": 0}, **extra,
            ).content,
            "pcm",
        ).samples  # fmt: skip
        assert len(streamed) == len(want), (text, len(streamed) / 960, len(want) / 960)
        assert snr_db(want, streamed) >= MIN_SNR_DB
        status, whole, headers = speech(
            higgs_server, input=text, voice=voice, response_format="wav", stream=False, **extra
        )
        assert status == 200 and int(headers["Content-Length"]) == len(whole)
        clip = decode(whole, "wav")
        assert clip.sample_rate == 24000
        assert len(clip.samples) == len(want), (text, len(clip.samples) / 960, len(want) / 960)
        assert snr_db(want, clip.samples) >= MIN_SNR_DB
    report_compared(record_property, [len(r["frames"]) for r in reference])


def test_formats_speed_and_models(higgs_server: ServerProcess) -> None:
    # seeded sampling (the same audio every time), the longest of a few answers: the random
    # model's greedy answers end after a few frames
    seeded = {"temperature": 1.0, "seed": 3}
    answers = [
        (len(speech(higgs_server, input=t, voice=v, response_format="pcm", **seeded)[1]), t, v)
        for t in TEXTS
        for v in ("higgs", CLONED)
    ]
    size, text, voice = max(answers)
    seconds = size / 2 / 24000
    assert seconds > 0.3, answers
    for fmt in ("mp3", "opus", "aac", "flac", "wav"):
        status, body, _ = speech(
            higgs_server, input=text, voice=voice, response_format=fmt, **seeded
        )
        assert status == 200, body[:300]
        clip = decode(body, fmt)
        assert clip.sample_rate in (24000, 48000), fmt  # opus decodes at 48 kHz
        assert abs(clip.seconds - seconds) < 0.1, (fmt, clip.seconds, seconds)
    status, fast, _ = speech(
        higgs_server, input=text, voice=voice, response_format="pcm", speed=2.0, **seeded
    )
    assert status == 200
    assert abs(len(fast) / 2 / 24000 - seconds / 2) < 0.05 * seconds + 0.05
    status, listing = higgs_server.get_json("/v1/models")
    [entry] = [m for m in listing["data"] if m["id"] == MODEL]
    assert entry["voices"] == VOICES and entry["default_voice"] == "higgs"
    # the tts_engine says how long a frame plays: each request's smallest lead over its
    # listener is observed there, as a stream stage's (the vocoder's chunks say nothing)
    metrics = samples(higgs_server.metrics())
    assert value(metrics, "omni_stage_stream_lead_seconds_count", stage="tts_engine") > 0
    assert value(metrics, "omni_stage_stream_lead_seconds_count", stage="vocoder") == 0


def test_voice_clone_encodes_once_and_unknown_voice_is_400(higgs_server: ServerProcess) -> None:
    for text in TEXTS:
        status, body, _ = speech(higgs_server, input=text, voice=CLONED, response_format="pcm")
        assert status == 200 and body
    assert len(re.findall(rf"encoded voice {CLONED}:", higgs_server.log())) == 1
    status, body, _ = speech(higgs_server, input="Hi there", voice="nobody")
    assert status == 400
    error = json.loads(body)["error"]
    assert error["param"] == "voice" and "higgs" in error["message"] and CLONED in error["message"]


def test_every_served_process_ran_without_transformers_or_torchaudio(
    higgs_server: ServerProcess, no_transformers: list[str]
) -> None:
    """The server the tests above spoke to (six formats, `joe` cloned, custom voices): it and
    each of its stage processes started under the blocker, where the import raises."""
    from tests.helpers.proc import descendants

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*no_transformers, *sys.path])}
    for name in ("transformers", "torchaudio"):
        run = subprocess.run([sys.executable, "-c", f"import {name}"], env=env,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert run.returncode == 1 and f"{name} is blocked here" in run.stderr, run.stderr
    workers = [
        pid
        for pid in descendants(higgs_server.proc.pid)
        if b"omni_server.stage.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(workers) == 3  # tts_frontend, pipeline, vocoder
    assert {higgs_server.proc.pid, *workers} <= blocked_pids(no_transformers)
    assert speech(higgs_server, input=TEXTS[0], voice=CLONED, response_format="flac")[0] == 200


def test_a_custom_voice_clones_as_the_reference_encodes_once_and_deletes(
    higgs_server: ServerProcess,
    custom_voice: dict[str, Any],
    references: list[dict[str, Any]],
) -> None:
    """A voice made with POST: greedy speech in it (the `openai` client) is the reference's for
    its stored clip and transcript; a second request reuses its codes; DELETE, then a 400."""
    import httpx2
    from openai import BadRequestError, OpenAI

    voice = custom_voice["id"]
    expected = references[len(CASES)]
    assert expected["frames"] != references[0]["frames"]  # the clip matters: same text
    status, listing = higgs_server.get_json(f"/v1/audio/voices?model={MODEL}")
    assert status == 200
    assert [v["id"] for v in listing["data"]] == [*VOICES, voice]

    client = OpenAI(base_url=higgs_server.url + "/v1", api_key="unused")
    want = np.array(expected["audio"], np.float32)
    for _ in range(2):
        pcm = client.audio.speech.create(
            model=MODEL, voice=voice, input=CUSTOM_TEXT, response_format="pcm",
            extra_body={"temperature": 0},
        ).content  # fmt: skip
        assert snr_db(want, decode(pcm, "pcm").samples) >= MIN_SNR_DB
    encoded = re.findall(rf"encoded voice {voice}: (\d+) frames", higgs_server.log())
    assert len(encoded) == 1  # once for both requests
    # the prompt's clip: its codes with BOS, EOS and the delay pattern, as the processor's
    assert int(encoded[0]) + len(expected["frames"][0]) + 1 == expected["prompt_frames"]

    answer = httpx2.delete(f"{higgs_server.url}/v1/audio/voices/{voice}", timeout=30)
    assert answer.status_code == 200 and answer.json()["deleted"] is True
    with pytest.raises(BadRequestError) as refused:
        client.audio.speech.create(model=MODEL, voice=voice, input=CUSTOM_TEXT)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "voice", error
    assert voice in error["message"] and all(v in error["message"] for v in VOICES)


def test_a_custom_voice_gone_mid_request_fails_it_with_a_400(
    higgs_server: ServerProcess, piper_clips: dict[str, tuple[Path, str]], data_dir: Path
) -> None:
    """The clip vanishes between the server's look-up and the encoder's read, as when a DELETE
    races the request: here the file is removed by hand, so the store still lists the voice
    when the request arrives. That request fails cleanly; the server serves on."""
    clip, transcript = piper_clips["custom"]
    voice = post_voice(higgs_server, clip, transcript)["id"]
    (data_dir / "voices" / f"{voice}.wav").unlink()
    status, body, _ = speech(higgs_server, input=CUSTOM_TEXT, voice=voice, response_format="pcm")
    assert status == 400, body[:300]
    error = json.loads(body)["error"]
    assert error["param"] == "voice" and error["code"] == "voice_not_found", error
    assert voice in error["message"] and "deleted" in error["message"]
    assert speech(higgs_server, input="Still serving.", response_format="pcm")[0] == 200


def test_a_voice_only_the_command_line_lists_is_served(higgs_server: ServerProcess) -> None:
    """`--models.higgs-audio-v2.voices` adds EXTRA (its clip in voices/): the preprocessing
    stage knows it from the compiled plan, not from repository.toml."""
    status, listing = higgs_server.get_json("/v1/models")
    [entry] = [m for m in listing["data"] if m["id"] == MODEL]
    assert entry["voices"] == VOICES
    status, body, _ = speech(higgs_server, input=TEXTS[1], voice=EXTRA, response_format="pcm")
    assert status == 200 and body
    assert len(re.findall(rf"encoded voice {EXTRA}:", higgs_server.log())) == 1


def test_bad_requests_are_400(higgs_server: ServerProcess) -> None:
    cases = [
        ({"input": ""}, "input"),
        ({"input": "Hello", "response_format": "ogg"}, "response_format"),
        ({"input": "Hello", "temperature": 3}, "temperature"),
        # the tiny model's context is 1024 tokens; 1920 characters its tokenizer never saw
        # (it was trained on a few sentences) are more
        ({"input": "Quizzical jackdaws vex my big sphinx of quartz. " * 40}, "input"),
    ]
    for body, param in cases:
        status, answer, _ = speech(higgs_server, **body)
        assert status == 400, (body, answer[:300])
        assert json.loads(answer)["error"]["param"] == param
    error = json.loads(speech(higgs_server, **cases[-1][0])[1])["error"]
    assert error["code"] == "context_length_exceeded"
    assert speech(higgs_server, input="Still serving.")[0] == 200


def test_abort_mid_stream_frees_the_kv_and_stops_the_vocoder(
    checkpoint: Path, no_transformers: list[str], tmp_path: Path
) -> None:
    """Every request runs to the context (ignore_eos): the client leaves after its first bytes."""
    import http.client

    overrides = ["--parameters.checkpoint", str(checkpoint),
                 "--stages.tts_engine.parameters.ignore_eos", "true"]  # fmt: skip
    with python_path(no_transformers):
        server = ServerProcess.start(REPO, tmp_path / "server.log", *overrides)
    with server:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        body = json.dumps({"model": "tts-1", "voice": CLONED, "input": TEXTS[0],
                           "response_format": "pcm"})  # fmt: skip
        connection.request("POST", "/v1/audio/speech", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        assert response.read1(4096)
        connection.close()  # mid-stream: the request has hundreds of frames to go
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "vocoder: stopped" not in server.log():
            time.sleep(0.2)
        log = server.log()
        freed = re.search(r"tts_engine: aborted \S+; KV blocks free (\d+)/(\d+)", log)
        assert freed is not None, log[-3000:]
        assert freed.group(1) == freed.group(2)  # every block back: the only request left
        stopped = re.search(r"vocoder: stopped \S+ after (\d+) columns \((\d+) streams", log)
        assert stopped is not None and stopped.group(2) == "0", log[-3000:]
        assert speech(server, input="Hi", response_format="pcm")[0] == 200


def start_error(checkpoint: Path | None, python_paths: list[str]) -> str:
    """omni-server on the example exits 1 with one ERROR line and no traceback: that line."""
    command = [sys.executable, "-m", "omni_server", "--repo", str(REPO), "--port", "0"]
    if checkpoint is not None:
        command += ["--parameters.checkpoint", str(checkpoint)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*python_paths, *sys.path])}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, done.stderr[-3000:]
    return errors[0]


def test_a_wrong_checkpoint_is_exit_1_with_one_line(
    checkpoint: Path, no_transformers: list[str], tmp_path: Path
) -> None:
    assert "--parameters.checkpoint DIR" in start_error(None, no_transformers)
    missing = tmp_path / "nowhere"
    assert f"checkpoint {missing}: no such folder" in start_error(missing, no_transformers)
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    line = start_error(other, no_transformers)
    assert str(other) in line and "model_type is 'llama'" in line
    mismatched = tmp_path / "mismatched"
    shutil.copytree(checkpoint, mismatched)
    config = json.loads((mismatched / "config.json").read_text())
    config["intermediate_size"] += 32
    (mismatched / "config.json").write_text(json.dumps(config))
    line = start_error(mismatched, no_transformers)
    assert str(mismatched) in line and "config.json implies" in line
    # the audio tokenizer's weights: one tensor gone (read by our own code, no transformers)
    from safetensors.torch import load_file, save_file

    lacking = tmp_path / "lacking"
    shutil.copytree(checkpoint, lacking)
    (lacking / "processor_config.json").unlink()  # it names the original's tokenizer folder
    weights = lacking / "audio_tokenizer" / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["fc2.bias"]
    save_file(tensors, str(weights))
    line = start_error(lacking, no_transformers)
    assert f"{weights}: lacks fc2.bias" in line


def test_repository_resolves_with_its_topology() -> None:
    from omni_server.compiler import compile_repository
    from omni_server.compiler.render import topology_text

    plan = compile_repository(REPO, ["--parameters.checkpoint", "/models/higgs"])
    assert plan.parameters == {"checkpoint": "/models/higgs"}
    text = topology_text(plan)
    for line in ("tts_frontend : preprocessing, audio_encoder", "pipeline     : tts_engine",
                 "vocoder      : vocoder, word_timing"):  # fmt: skip
        assert line in text
