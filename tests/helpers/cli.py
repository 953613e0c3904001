"""Run the `omni-server` command line in the test's own process."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from omni_server.cli import main


def exit_of(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`omni-server ARGV` as `python -m omni_server` runs it (`SystemExit(main())`), without the
    second interpreter: its exit code and stderr. Any other exception escapes and fails the test,
    as its traceback would in the real command (tests/compiler/test_cli.py runs that once).
    Only for arguments refused before anything starts: valid ones would serve here."""
    try:
        code = main(list(argv))
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    return code, capsys.readouterr().err


def resolved_config(
    repo: Path, overrides: Sequence[str], capsys: pytest.CaptureFixture[str]
) -> dict[str, Any]:
    """`omni-server config resolve --repo REPO --show config --format json OVERRIDES` (nothing
    starts, so it runs here): the config it prints."""
    argv = ["config", "resolve", "--repo", str(repo), "--show", "config", "--format", "json"]
    code = main([*argv, *overrides])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    return json.loads(printed.out)
