"""The engine's generic parts name no model family and no modality (docs/engine.md, "Adding a
family"): what a step emits is the family's head (engine/head.py), reached only through it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "server" / "omni_server" / "engine"

# the step, the runner, the decode graphs, the workspace probe and the batcher
GENERIC = ("engine.py", "runner.py", "cuda_graphs.py", "workspace.py", "batcher.py")
FAMILY_WORDS = re.compile(r"audio|frame|higgs|delay|codebook", re.IGNORECASE)
# what the step runs on: a family's module reaches them through head.py's protocols only
STEP_PARTS = (*GENERIC, "head.py", "token_head.py", "kernels.py", "attention.py", "sequence.py")


@pytest.mark.parametrize("name", GENERIC)
def test_generic_engine_files_name_no_family(name: str) -> None:
    lines = (ENGINE / name).read_text(encoding="utf-8").splitlines()
    hits = [f"{name}:{i}: {text.strip()}" for i, text in enumerate(lines, 1)]
    hits = [hit for hit in hits if FAMILY_WORDS.search(hit.split(": ", 1)[1])]
    assert not hits, "a family's words in a generic engine file:\n" + "\n".join(hits)


@pytest.mark.parametrize("name", STEP_PARTS)
def test_the_step_imports_no_family(name: str) -> None:
    """Models come from the one load path (loading.py, the families' registry); nothing the
    step runs on imports a family's module."""
    text = (ENGINE / name).read_text(encoding="utf-8")
    assert "engine.families" not in text, f"{name} imports a family"
