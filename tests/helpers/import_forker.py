"""The fork server of tests/helpers/fresh_import.py: `python -m tests.helpers.import_forker`.

It imports the third-party libraries our modules import (PRELOAD) and none of ours, then for
each module name read from stdin forks a child that imports that module, and writes one JSON
line to stdout: `{"module": name, "error": null | traceback}`. A child starts as a fresh
interpreter would after importing those libraries; it checks that no module of ours is loaded
before it imports. stdin at its end: the server exits.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import time
import traceback

OURS = ("omni_server", "omni_transport", "omni_client", "omni_bench")
# Loaded once here. A library missing from this list is imported by each child (slower, the
# same result); one that is not installed is skipped.
PRELOAD = (
    "numpy",
    "torch",
    "av",
    "soxr",
    "aiohttp.web",
    "pydantic",
    "zmq",
    "cffi",
    "onnxruntime",
    "prometheus_client",
    "jinja2",
    "tokenizers",
    "gguf",
    "httpx2",
    "tqdm",
)
CHILD_TIMEOUT_S = 120.0


def _child(module: str, answer: int) -> None:
    """In the forked child: never returns (os._exit: the server's loop must not go on here)."""
    loaded = sorted(name for name in sys.modules if name.split(".")[0] in OURS)
    error = f"not alone: {', '.join(loaded)} already imported" if loaded else ""
    if not error:
        try:
            importlib.import_module(module)
        except BaseException:  # noqa: BLE001  reported to the test: this child's whole job
            error = traceback.format_exc()
    with os.fdopen(answer, "w") as out:
        out.write(error)
    os._exit(1 if error else 0)


def _import_alone(module: str) -> str | None:
    reading, writing = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(reading)
        _child(module, writing)
    os.close(writing)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    with os.fdopen(reading) as answer:
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return f"import {module} took over {CHILD_TIMEOUT_S:g} s"
        text = answer.read()
    status = os.waitstatus_to_exitcode(done[1])
    if status == 0:
        return None
    return text or f"import {module} ended its process (exit status {status})"


def main() -> None:
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    for line in sys.stdin:
        module = line.strip()
        print(json.dumps({"module": module, "error": _import_alone(module)}), flush=True)


if __name__ == "__main__":
    main()
