"""docs/repository.md stays true to the code: its example compiles to the output it shows,
its command transcripts are what the commands print, and its field tables list every field."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from omni_server.cli import main
from omni_server.compiler.schema import (
    ENGINE_FIELDS,
    MODEL_FIELDS,
    PROCESS_FIELDS,
    SAMPLING_FIELDS,
    SCHEDULER_FIELDS,
    SERVER_FIELDS,
    STAGE_FIELDS,
    Kind,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "repository.md"
FENCE = re.compile(r"^```(\w*) ?([^\n]*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks() -> list[tuple[str, str, str]]:
    """(language, info after the language, body) of every fenced block."""
    return [(m[1], m[2].strip(), m[3]) for m in FENCE.finditer(DOC.read_text())]


def write_example(root: Path) -> list[str]:
    """The worked example's files, written out from the doc's file blocks under `root`."""
    files = []
    for lang, info, body in blocks():
        if lang in ("toml", "python") and info:
            path = root / info
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body)
            files.append(info)
    return files


@pytest.fixture
def example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The worked example as ./example, resolved as on a machine without a GPU (the doc's
    output): CUDA_VISIBLE_DEVICES="" hides any GPU from discovery, as from CUDA."""
    root = tmp_path / "example"
    assert len(write_example(root)) == 7
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return root


def run(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    main(argv)
    captured = capsys.readouterr()
    return captured.out + captured.err


def test_example_output_matches(example: Path, capsys: pytest.CaptureFixture) -> None:
    shown = [body for lang, info, body in blocks() if info.startswith("omni-server config")]
    assert len(shown) == 1
    assert run(["config", "resolve", "--repo", "example"], capsys) == shown[0]


def test_transcripts_match(example: Path, capsys: pytest.CaptureFixture) -> None:
    transcripts = [body for lang, info, body in blocks() if "$ omni-server" in body]
    assert transcripts
    for body in transcripts:
        for command in re.split(r"^\$ ", body, flags=re.MULTILINE)[1:]:
            line, _, expected = command.partition("\n")
            argv = line.split()[1:]
            assert run(argv, capsys) == expected, line


def test_python_snippet(example: Path) -> None:
    from omni_server.compiler.compiler import compile_repository

    plan = compile_repository("example", ["--processes.encoder.num_replicas", "3"])
    assert plan.processes["encoder"].num_replicas == 3
    assert [i.name for i in plan.instances_of("encoder")] == [
        "encoder@r0",
        "encoder@r1",
        "encoder@r2",
    ]


@pytest.mark.parametrize(
    "fields",
    [
        STAGE_FIELDS,
        SCHEDULER_FIELDS,
        ENGINE_FIELDS,
        SAMPLING_FIELDS,
        SERVER_FIELDS,
        MODEL_FIELDS,
        PROCESS_FIELDS,
    ],
)
def test_every_field_documented(fields) -> None:
    text = DOC.read_text()
    for name, spec in fields.items():
        cell = f"| `[{name}]` |" if spec.kind is Kind.TABLE else f"| `{name}` |"
        assert cell in text, f"{name} is missing from docs/repository.md"


def test_no_undocumented_field_in_tables() -> None:
    known = {
        *STAGE_FIELDS,
        *SCHEDULER_FIELDS,
        *ENGINE_FIELDS,
        *SAMPLING_FIELDS,
        *SERVER_FIELDS,
        *MODEL_FIELDS,
        *PROCESS_FIELDS,
    }
    rows = re.findall(r"^\| `\[?([a-z_]+)\]?` \|", DOC.read_text(), flags=re.MULTILINE)
    assert rows and set(rows) <= known


def test_example_backends_run(example: Path) -> None:
    """The example's model.py files work against the backend API, chained by hand here
    (`test_example_serves_every_format` runs them in the server)."""
    import importlib.util

    from omni_server.audio import decode
    from omni_server.backend import Request, StageContext
    from omni_server.contracts import SpeechOptions, speech_payload

    def load(stage: str, cls: str, parameters: dict):
        spec = importlib.util.spec_from_file_location(f"doc_{stage}", example / stage / "model.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        backend = getattr(module, cls)()
        backend.initialize(StageContext(stage, parameters, "cpu", example, example / stage))
        return backend

    frontend = load("frontend", "Frontend", {"language": "en-us"})
    synth = load("synth", "Synth", {"sample_rate": 22050, "chunk_phonemes": 20})
    encoder = load("encoder", "Encoder", {})

    inputs = speech_payload("hello " * 9, SpeechOptions("default", response_format="wav"))
    (phonemes,) = frontend.execute([Request("r1", inputs)])
    assert len(phonemes["phonemes"]) == 54
    chunks = []
    gen = synth.generate(Request("r1", phonemes))
    while True:
        try:
            chunks.append(next(gen))
        except StopIteration as stop:
            result = stop.value
            break
    per_phoneme = int(0.08 * 22050)
    assert [len(c["audio"]) for c in chunks] == [
        20 * per_phoneme,
        20 * per_phoneme,
        14 * per_phoneme,
    ]
    assert result == {"native_rate": 22050, "format": "wav", "sample_rate": None}
    (audio,) = encoder.execute([Request("r1", result, _stream=iter(chunks))])
    assert audio["sample_rate"] == 22050 and audio["format"] == "wav"
    clip = decode(audio["audio"], "wav")
    assert clip.sample_rate == 22050 and len(clip.samples) == 54 * per_phoneme
    assert np.sqrt(np.mean(clip.samples**2)) > 0.05  # a tone, not silence


# (format, sample_rate asked, the container FFmpeg must find, the rate it must carry)
FORMATS = [
    ("mp3", None, "mp3", 22050),
    ("opus", None, "ogg", 48000),  # Ogg Opus decodes at 48 kHz, whatever it was coded at
    ("aac", None, "aac", 22050),
    ("flac", None, "flac", 22050),
    ("wav", None, "wav", 22050),
    ("wav", 16000, "wav", 16000),
    ("pcm", None, None, 24000),
]


@pytest.mark.slow  # a real server: four stage processes, one of them importing torch
def test_example_serves_every_format(tmp_path: Path) -> None:
    """The seven files copied out of the doc serve as the doc says: on this machine (device
    "auto"), audio in the format asked, non-silent, as long as the text says (80 ms a
    character), streamed or not."""
    from omni_server.audio import decode
    from omni_server.audio.decode import container_name
    from tests.helpers.server import ServerProcess

    root = tmp_path / "example"
    write_example(root)
    text = "Hello world"
    with ServerProcess.start(root, tmp_path / "server.log") as server:
        for fmt, rate, container, decoded_rate in FORMATS:
            for stream in (False, True):
                body = {"model": "tts-1", "voice": "alloy", "input": text}
                body |= {"response_format": fmt, "stream": stream}
                if rate is not None:
                    body["sample_rate"] = rate
                audio = _post(server.url + "/v1/audio/speech", body)
                what = f"{fmt} at {rate}, stream={stream}"
                if container is not None:
                    assert container_name(audio) == container, what
                clip = decode(audio, fmt)
                assert clip.sample_rate == decoded_rate, what
                assert clip.seconds == pytest.approx(0.08 * len(text), abs=0.06), what
                assert np.sqrt(np.mean(clip.samples**2)) > 0.05, what  # not silence


def _post(url: str, body: dict) -> bytes:
    import json
    import urllib.request

    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        return response.read()
