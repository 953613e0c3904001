"""Bad command lines end with exit code 2 and one line, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from omni_bench.cli import SUBCOMMANDS, main
from omni_bench.harness.server import free_port


def run(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from omni_bench.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["frobnicate"], "unknown subcommand 'frobnicate'"),
        (["speech", "--peer", "in-process", "--concurrency", "1,x"], "expected integers"),
        (["speech", "--peer", "in-process", "--dataset", "/nonexistent.txt"], "/nonexistent.txt"),
        (["speech"], "nothing to measure"),
        (["speech", "--serve", "--url", "http://127.0.0.1:1"], "give one of them"),
        (["speech", "--serve", "--repo", "/nonexistent"], "/nonexistent: no repository.toml"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1


def test_unreachable_server_is_exit_2_without_traceback():
    port = free_port()  # nothing listens here
    proc = run("speech", "--url", f"http://127.0.0.1:{port}", "--requests", "1")
    assert proc.returncode == 2
    assert f"cannot reach http://127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_lists_the_subcommands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "speech" in out and "transport" in out


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("doc", ["README.md", "docs/benchmarks.md"])
def test_the_docs_name_every_subcommand(doc):
    text = (ROOT / doc).read_text()
    missing = [name for name in SUBCOMMANDS if f"omni-bench {name} " not in text.replace("`", " ")]
    assert not missing, f"{doc} does not list omni-bench {', '.join(missing)}"


def test_help_has_one_line_per_subcommand(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out.splitlines()
    lines = [line for line in out if line.startswith("  ") and not line.startswith("   ")]
    assert [line.split()[0] for line in lines] == list(SUBCOMMANDS)
