"""Import modules of ours as a fresh interpreter would, without paying a fresh interpreter each.

A fresh `python -c "import omni_server.x"` per module costs seconds where torch is imported
(about 4 s of a loaded 2-core machine each, over 200 modules: five minutes). `FreshImports`
starts one fork server (tests/helpers/import_forker.py) that has the third-party libraries
loaded and none of our modules; each module is imported in a child forked from it, which checks
that nothing of ours is loaded first. An import cycle, a missing import or a module that only
works after another one was imported fails exactly as in a fresh interpreter.

    with FreshImports() as fresh:
        assert fresh.error("omni_server.serve.app") is None
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class FreshImports:
    def __init__(self) -> None:
        self._server = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.import_forker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )

    def error(self, module: str) -> str | None:
        """None when `module` imports alone; else its traceback."""
        assert self._server.stdin is not None and self._server.stdout is not None
        self._server.stdin.write(module + "\n")
        self._server.stdin.flush()
        line = self._server.stdout.readline()
        if not line:
            raise RuntimeError(f"the import fork server ended (exit {self._server.poll()})")
        answer = json.loads(line)
        assert answer["module"] == module, answer
        return answer["error"]

    def close(self) -> None:
        """End the fork server (stdin closed) and wait for it."""
        if self._server.stdin is not None:
            self._server.stdin.close()
        try:
            self._server.wait(30)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()
        if self._server.stdout is not None:
            self._server.stdout.close()

    def __enter__(self) -> FreshImports:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
