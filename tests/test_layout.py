"""The layout stays readable: no module of the server over 500 lines (small modules, one idea
each; a module that grows past it is split by idea, not by line count)."""

from __future__ import annotations

from pathlib import Path

SERVER = Path(__file__).resolve().parents[1] / "server" / "omni_server"
MAX_LINES = 500


def test_no_server_module_over_500_lines() -> None:
    long = {
        str(path.relative_to(SERVER)): n
        for path in sorted(SERVER.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"
