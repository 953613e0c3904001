"""The stage of `omni-bench overhead`: returns its inputs, so all that is measured is the framework.

Copied into the benchmark's temporary repository as each stage's model.py.
"""

from __future__ import annotations

from omni_server.backend import Payload, Request, StageBackend


class Empty(StageBackend):
    def execute(self, requests: list[Request]) -> list[Payload]:
        return [r.inputs for r in requests]
