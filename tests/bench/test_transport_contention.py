"""omni-bench transport --contention: one quick run prints every row, quiet and with one core
busy, the ratios to pyzmq both ways, and what the client's waits did."""

from __future__ import annotations

import subprocess
import sys

import pytest

from omni_bench.transport import CONTENTION_ROWS, main


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_contention_prints_both_policies_quiet_and_busy():
    # its own process: the benchmark's spawned processes (and multiprocessing's resource
    # tracker) end with it
    out = subprocess.run(
        [sys.executable, "-m", "omni_bench.transport", "--contention", "--quick", "--runs", "1"],
        capture_output=True,
        text=True,
        timeout=280,
        check=True,
    ).stdout
    assert "| method | quiet | one core busy |" in out
    for label, check, _ in CONTENTION_ROWS:
        assert out.count(f"| {label} |") == 1 + (check is not None)  # rtt row (+ waits row)
        if check is not None:
            assert f"- {label} / pyzmq, quiet: " in out
            assert f"- {label} / pyzmq, one core busy: " in out


def test_cuda_and_contention_exclude_each_other(capsys):
    assert main(["--contention", "--cuda"]) == 2
    assert "give one" in capsys.readouterr().err
