"""The model control flags of `omni-server`: what disagrees exits 2 with one line, before any
stage process starts (run in this process: tests/helpers/cli.py; `--help` in the real command)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.cli import exit_of
from tests.helpers.server import EMBEDDED_REPO, ROOT

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--load-model", "piper-joe"], "--load-model needs --model-control-mode explicit"),
        (
            ["--model-control-mode", "explicit", "--load-model", "*", "--load-model", "a"],
            "must be the only --load-model",
        ),
        (["--model-control-mode", "explicit", "--load-model", "nope"], "no model 'nope'"),
        (["--model-control-mode", "poll", "--repository-poll-secs", "0"], "must be above 0"),
        (["--model-control-mode", "sometimes"], "invalid choice"),
    ],
)
def test_disagreeing_flags_exit_2(flags, says, capsys):
    code, stderr = exit_of(["--repo", str(EMBEDDED_REPO), "--port", "0", *flags], capsys)
    assert code == 2, stderr
    assert says in stderr
    assert "Traceback" not in stderr


def test_help_names_the_flags():
    done = subprocess.run(
        [sys.executable, "-m", "omni_server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    for flag in (
        "--model-control-mode",
        "--load-model",
        "--repository-poll-secs",
        "--disable-repository-api",
    ):
        assert flag in done.stdout


def test_explicit_control_on_a_public_address_needs_a_key(capsys, monkeypatch):
    """Issue 42.2: without a key the control routes are for this host's users only (a loopback
    bind, whose Host check also stops DNS rebinding); on any other address a key is required
    to start at all."""
    monkeypatch.delenv("OMNI_SERVER_API_KEY", raising=False)

    def exit_line(*flags: str) -> tuple[int, str]:
        return exit_of(["--repo", str(EMBEDDED_REPO), "--port", "0", *flags], capsys)

    code, stderr = exit_line("--model-control-mode", "explicit", "--host", "0.0.0.0")
    assert code == 2, stderr
    assert "not a loopback address" in stderr and "--api-key" in stderr
    assert "Traceback" not in stderr
    # with a key (or the API off) the check passes: the next check, an unknown model, speaks
    for extra in (["--api-key", "k" * 24], ["--disable-repository-api"]):
        code, stderr = exit_line(
            "--model-control-mode", "explicit", "--host", "0.0.0.0", "--load-model", "nope", *extra
        )
        assert code == 2 and "no model 'nope'" in stderr, stderr
