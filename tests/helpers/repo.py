"""Build model repositories in temporary folders for tests.

    root = make_repo(
        tmp_path,
        stages={
            "tts": toml('''
                backend = "Tts"
                terminal = true
            '''),
        },
        repository=toml('''
            [models.m]
            entry = "tts"
            tasks = ["speech"]
        '''),
    )

Each stage folder gets its `stage.toml` and a `model.py`: by default a trivial backend whose
class name is read from the descriptor's `backend` field, or the file given in `models` (a
backend under `tests/fixtures/`), or the source text given there.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from textwrap import dedent

TRIVIAL_BACKEND = '''\
from omni_server.backend import StageBackend


class {name}(StageBackend):
    """A test stage: echoes its inputs."""

    def execute(self, requests):
        return [dict(r.inputs) for r in requests]
'''


def toml(text: str) -> str:
    """TOML written indented inside a test, as its file reads: dedented, without the newline
    after the opening quotes. Parts made this way concatenate into one valid file."""
    return dedent(text).removeprefix("\n")


def make_repo(
    root: Path,
    stages: Mapping[str, str],
    repository: str = "",
    models: Mapping[str, str | Path] | None = None,
) -> Path:
    """Write `repository.toml` and one folder per stage; returns `root`.

    `stages` maps stage name -> stage.toml text; `models` optionally maps stage name -> its
    model.py: a file to copy, or source text (default: a trivial backend named after `backend`).
    """
    root.mkdir(parents=True, exist_ok=True)
    (root / "repository.toml").write_text(dedent(repository))
    for name, text in stages.items():
        folder = root / name
        folder.mkdir(exist_ok=True)
        text = dedent(text)
        (folder / "stage.toml").write_text(text)
        source = (models or {}).get(name)
        if source is None:
            source = TRIVIAL_BACKEND.format(name=_class_name(text) or "Backend")
        elif isinstance(source, Path):
            source = source.read_text()
        (folder / "model.py").write_text(dedent(source))
    return root


def _class_name(stage_toml: str) -> str | None:
    try:
        backend = tomllib.loads(stage_toml).get("backend")
    except tomllib.TOMLDecodeError:
        return None  # a test of bad TOML: the backend does not matter
    if not isinstance(backend, str):
        return None
    name = backend.rpartition(":")[2]
    return name if name.isidentifier() else None
