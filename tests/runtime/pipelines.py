"""Test repositories for the runtime: small CPU backends (tests/fixtures/runtime_stages.py) in
any process topology."""

from __future__ import annotations

from pathlib import Path

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.plan import Plan
from tests.fixtures import FIXTURES
from tests.helpers.repo import make_repo

# One file for every test stage: each stage.toml picks its class.
BACKENDS = FIXTURES / "runtime_stages.py"


def _stage(cls: str, extra: str = "", process: str | None = None) -> str:
    lines = [f'backend = "model.py:{cls}"']
    if process:
        lines.append(f'process = "{process}"')
    return "\n".join(lines) + "\n" + extra


def build(root: Path, stages: dict[str, str], models: str, processes: str = "") -> Plan:
    make_repo(root, stages, models + "\n" + processes, {name: BACKENDS for name in stages})
    return compile_repository(root)


def chain(root: Path, layout: str) -> Plan:
    """a -> b -> c (terminal), each Add; layout: 'one' process, 'split', or 'replicated'."""
    proc = {"one": ("p", "p", "p"), "split": ("a", "b", "c"), "replicated": ("a", "bc", "bc")}
    pa, pb, pc = proc[layout]
    stages = {
        "a": _stage("Add", 'next = "b"\n[parameters]\nk = 1\n', pa),
        "b": _stage("Add", 'next = "c"\n[parameters]\nk = 2\n', pb),
        "c": _stage("Add", "terminal = true\n[parameters]\nk = 3\n", pc),
    }
    processes = ""
    if layout == "replicated":
        processes = "[processes.a]\nnum_replicas = 2\n[processes.bc]\nnum_replicas = 3\n"
    return build(root, stages, '[models.m]\nentry = "a"\ntasks = ["speech"]\n', processes)


def stream(
    root: Path,
    layout: str,
    marker_dir: Path | None = None,
    front: int = 1,
    back: int = 1,
    binding: str | None = None,
):
    """[a ->] speak --stream_to--> voice (terminal); layout 'one', 'split' or 'replicated'
    (a in process front, speak + voice in process back, with `front` / `back` replicas, bound
    by `binding` when given)."""
    params = f'[parameters]\nmarker_dir = "{marker_dir}"\nk = 0\n' if marker_dir else ""
    procs = {"one": ("p", "p"), "split": ("speak", "voice"), "replicated": ("back", "back")}
    speak_proc, voice_proc = procs[layout]
    stream = '[scheduler]\nkind = "stream"\n'
    stages = {
        "speak": _stage("Speak", 'stream_to = "voice"\n' + stream + params, speak_proc),
        "voice": _stage("Voice", "terminal = true\n" + stream + params, voice_proc),
    }
    entry = "speak"
    processes = ""
    if layout == "replicated":
        stages["a"] = _stage("Add", 'next = "speak"\n[parameters]\nk = 1\n', "front")
        entry = "a"
        processes = (
            f"[processes.front]\nnum_replicas = {front}\n[processes.back]\nnum_replicas = {back}\n"
        )
        if binding is not None:
            processes += f'binding = "{binding}"\n'  # [processes.back] is the last table
    return build(root, stages, f'[models.m]\nentry = "{entry}"\ntasks = ["speech"]\n', processes)
