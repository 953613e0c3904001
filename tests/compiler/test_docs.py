"""docs/repository.md stays true to the code: its example compiles to the output it shows,
its command transcripts are what the commands print, and its field tables list every field."""

from __future__ import annotations

import re
from pathlib import Path

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


@pytest.fixture
def example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The worked example written out from the doc's file blocks, as ./example."""
    root = tmp_path / "example"
    for lang, info, body in blocks():
        if lang in ("toml", "python") and info:
            path = root / info
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body)
    monkeypatch.chdir(tmp_path)
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
    """The example's model.py files work against the backend API, chained by hand here (the
    runtime's own tests run pipelines for real)."""
    import importlib.util

    from omni_server.backend import Request, StageContext

    def load(stage: str, cls: str, parameters: dict):
        spec = importlib.util.spec_from_file_location(f"doc_{stage}", example / stage / "model.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        backend = getattr(module, cls)()
        backend.initialize(StageContext(stage, parameters, "cpu", example, example / stage))
        return backend

    frontend = load("frontend", "Frontend", {"language": "en-us"})
    synth = load("synth", "Synth", {"chunk_frames": 20})
    encoder = load("encoder", "Encoder", {"sample_rate": 22050})

    (phonemes,) = frontend.execute([Request("r1", {"text": "hello " * 9})])
    assert len(phonemes["phonemes"]) == 54
    chunks = []
    gen = synth.generate(Request("r1", phonemes))
    while True:
        try:
            chunks.append(next(gen))
        except StopIteration as stop:
            result = stop.value
            break
    assert [len(c["frames"]) for c in chunks] == [20, 20, 14]
    assert result == {"num_phonemes": 54}
    (audio,) = encoder.execute([Request("r1", result, _stream=iter(chunks))])
    assert len(audio["audio"]) == 2 * 54 and audio["sample_rate"] == 22050
