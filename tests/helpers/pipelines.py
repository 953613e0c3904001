"""Test repositories for the runtime: small CPU backends (tests/fixtures/runtime_stages.py) in
any process topology."""

from __future__ import annotations

from pathlib import Path

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.plan import Plan
from tests.fixtures import FIXTURES
from tests.helpers.repo import make_repo, toml

# One file for every test stage: each stage.toml picks its class.
BACKENDS = FIXTURES / "runtime_stages.py"


def stage_toml(cls: str, extra: str = "", process: str | None = None) -> str:
    """A stage.toml running class `cls` of BACKENDS (in `process` when given), then `extra`."""
    placed = f'process = "{process}"\n' if process else ""
    return f'backend = "model.py:{cls}"\n{placed}{extra}'


def build(root: Path, stages: dict[str, str], models: str, processes: str = "") -> Plan:
    make_repo(root, stages, models + "\n" + processes, {name: BACKENDS for name in stages})
    return compile_repository(root)


def chain(root: Path, layout: str) -> Plan:
    """a -> b -> c (terminal), each Add; layout: 'one' process, 'split', or 'replicated'."""
    proc = {"one": ("p", "p", "p"), "split": ("a", "b", "c"), "replicated": ("a", "bc", "bc")}
    pa, pb, pc = proc[layout]
    stages = {
        "a": stage_toml(
            "Add",
            toml("""
                next = "b"
                [parameters]
                k = 1
            """),
            pa,
        ),
        "b": stage_toml(
            "Add",
            toml("""
                next = "c"
                [parameters]
                k = 2
            """),
            pb,
        ),
        "c": stage_toml(
            "Add",
            toml("""
                terminal = true
                [parameters]
                k = 3
            """),
            pc,
        ),
    }
    processes = ""
    if layout == "replicated":
        processes = toml("""
            [processes.a]
            num_replicas = 2
            [processes.bc]
            num_replicas = 3
        """)
    return build(
        root,
        stages,
        toml("""
            [models.m]
            entry = "a"
            tasks = ["speech"]
        """),
        processes,
    )


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
    params = (
        toml(f"""
            [parameters]
            marker_dir = "{marker_dir}"
            k = 0
        """)
        if marker_dir
        else ""
    )
    procs = {"one": ("p", "p"), "split": ("speak", "voice"), "replicated": ("back", "back")}
    speak_proc, voice_proc = procs[layout]
    stream = toml("""
        [scheduler]
        kind = "stream"
    """)
    stages = {
        "speak": stage_toml("Speak", 'stream_to = "voice"\n' + stream + params, speak_proc),
        "voice": stage_toml("Voice", "terminal = true\n" + stream + params, voice_proc),
    }
    entry = "speak"
    processes = ""
    if layout == "replicated":
        stages["a"] = stage_toml(
            "Add",
            toml("""
                next = "speak"
                [parameters]
                k = 1
            """),
            "front",
        )
        entry = "a"
        processes = toml(f"""
            [processes.front]
            num_replicas = {front}
            [processes.back]
            num_replicas = {back}
        """)
        if binding is not None:
            processes += f'binding = "{binding}"\n'  # [processes.back] is the last table
    return build(
        root,
        stages,
        toml(f"""
            [models.m]
            entry = "{entry}"
            tasks = ["speech"]
        """),
        processes,
    )
