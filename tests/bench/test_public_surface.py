"""Benchmarks reach the server only through its public surfaces, so a refactor inside a room
cannot break them: every import of omni_server / omni_transport in tools/omni_bench names a
public module, imports only names that module exports (its `__all__`), and none with a leading
underscore."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "tools" / "omni_bench"

# The public modules: the rooms' packages (what their `__init__` exports is public on purpose)
# and the audio helpers for stage authors, each of its modules public.
PUBLIC = {
    "omni_server.backend",  # the stage-author API
    "omni_server.compiler",  # compile_repository, Plan, ModelSpec
    "omni_server.contracts",  # what stages hand each other: SpeechOptions, ChatInput, ...
    "omni_server.engine",  # the AR engine's API
    "omni_server.gpu",  # discover
    "omni_server.pipeline",  # Runtime, RequestHandle, PipelineError
    "omni_server.stage",  # load_backend
    "omni_server.wire",  # Endpoint
    "omni_transport",  # the transport's Python API
}
# the package and every module in it: the audio helpers, and the model families' own code
# (omni_server.models imports nothing of the server's: tests/test_imports.py)
PUBLIC_PREFIXES = ("omni_server.audio", "omni_server.models")
SERVER_PACKAGES = ("omni_server", "omni_transport")


def bench_files() -> list[Path]:
    return sorted(BENCH.rglob("*.py"))


def server_imports(tree: ast.AST) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None for `import module`) of every omni_server / omni_transport
    import in the tree, at module level or inside functions alike."""
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
    return [(line, m, n) for line, m, n in found if m.split(".")[0] in SERVER_PACKAGES]


def is_public(module: str) -> bool:
    return module in PUBLIC or any(
        module == p or module.startswith(p + ".") for p in PUBLIC_PREFIXES
    )


def problems(source: str) -> list[str]:
    """What is wrong with one file's server imports, one line each."""
    out = []
    for line, module, name in server_imports(ast.parse(source)):
        if any(part.startswith("_") for part in module.split(".")):
            out.append(f"line {line}: imports private module {module}")
        elif name is None and module not in SERVER_PACKAGES and not is_public(module):
            out.append(f"line {line}: imports {module}, not a public module")
        elif name is not None and name.startswith("_"):
            out.append(f"line {line}: imports private name {module}.{name}")
        elif name is not None and not is_public(module):
            public_module = f"{module}.{name}"
            if not is_public(public_module):  # `from omni_server.audio import whisper`
                out.append(f"line {line}: imports {name} from {module}, not a public module")
        elif name is not None and module in PUBLIC:
            exported = getattr(importlib.import_module(module), "__all__", None)
            if exported is not None and name not in exported:
                out.append(f"line {line}: {module} does not export {name} (its __all__)")
    return out


def test_the_benchmark_files_are_found() -> None:
    names = {p.name for p in bench_files()}
    assert {"cli.py", "speech.py", "gpu_handoff.py", "server.py"} <= names


@pytest.mark.parametrize("path", bench_files(), ids=lambda p: str(p.relative_to(BENCH)))
def test_benchmark_imports_only_public_server_names(path: Path) -> None:
    assert not problems(path.read_text()), "\n".join(problems(path.read_text()))


@pytest.mark.parametrize(
    ("source", "why"),
    [
        ("from omni_server.wire.channels import Endpoint", "not a public module"),
        ("from omni_server.pipeline.runtime import Runtime", "not a public module"),
        ("import omni_server.stage.tp", "not a public module"),
        ("def f():\n    from omni_server.engine.parallel import TensorParallel", "not a public"),
        ("from omni_server.pipeline import _private", "private name"),
        ("from omni_transport._ffi import lib", "private module"),
        ("from omni_server.engine import Sequence", "does not export Sequence"),
    ],
)
def test_the_check_refuses(source: str, why: str) -> None:
    [problem] = problems(source)
    assert why in problem


@pytest.mark.parametrize(
    "source",
    [
        "from omni_server.compiler import compile_repository",
        "from omni_server.audio import whisper",
        "from omni_server.audio.decode import Clip",
        "from omni_transport import Ring, CudaPool",
        "import omni_transport",
        "import aiohttp",
    ],
)
def test_the_check_allows(source: str) -> None:
    assert problems(source) == []
