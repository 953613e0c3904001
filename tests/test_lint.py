"""The tree stays ruff-clean (lint and format) and mypy-clean, as configured in pyproject.toml."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    found = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (it comes with the `test` extra)")
    return [found]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_clean(args: list[str]) -> None:
    run = subprocess.run(
        [*_ruff(), *args, "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_mypy_clean() -> None:
    """mypy over omni_server, omni_transport and omni_client (`[tool.mypy] files`)."""
    found = shutil.which("mypy", path=str(Path(sys.executable).parent)) or shutil.which("mypy")
    if found is None:
        pytest.skip("mypy is not installed (it comes with the `test` extra)")
    run = subprocess.run([found], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-2000:]
