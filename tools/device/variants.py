"""What the device's A/B scripts (crossing_ab.py, ring_cpu_cost.py) share: the variants they
compare, each a source tree with its own environment run in a fresh child process, the child's
one-line JSON result, and the percentiles of the tables."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any


def parse(specs: list[str]) -> list[tuple[str, str, dict[str, str]]]:
    """`NAME=TREE[:ENV=V,...]` -> (name, absolute tree, extra environment) each."""
    variants = []
    for spec in specs:
        name, rest = spec.split("=", 1)
        tree, _, envs = rest.partition(":")
        env = dict(e.split("=", 1) for e in envs.split(",") if e)
        variants.append((name, os.path.abspath(tree), env))
    return variants


def carried_paths() -> list[str]:
    """The PYTHONPATH entries under /tmp (the carried wheels' site), which every child keeps."""
    return [p for p in os.environ.get("PYTHONPATH", "").split(":") if p.startswith("/tmp")]


def run_child(cmd: list[str], env: dict[str, str], timeout: int) -> tuple[Any, str, str | None]:
    """(the child's `RESULT <json>` value, its stdout, None) or (None, stdout, why it failed)."""
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or not line:
        return None, done.stdout, f"rc={done.returncode}\n{done.stderr[-3000:]}"
    return json.loads(line[0][len("RESULT ") :]), done.stdout, None


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]
