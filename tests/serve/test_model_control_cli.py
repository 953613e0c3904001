"""The model control flags of `omni-server`: what disagrees exits 2 with one line, before any
stage process starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
def test_disagreeing_flags_exit_2(flags, says):
    done = subprocess.run(
        [sys.executable, "-m", "omni_server", "--repo", str(EMBEDDED_REPO), "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stderr
    assert says in done.stderr
    assert "Traceback" not in done.stderr


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
