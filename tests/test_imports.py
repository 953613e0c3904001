"""Every module of every package imports alone, as in a fresh interpreter: no import cycle hides
behind the order in which other modules happened to be imported first. Each import runs in a
child forked from a server that holds the third-party libraries and none of our modules
(tests/helpers/fresh_import.py): a fresh interpreter each would cost seconds of torch import."""

from __future__ import annotations

import ast
import graphlib
import importlib.util
import pkgutil
from collections.abc import Iterator
from importlib import import_module
from pathlib import Path

import pytest

from tests.helpers.fresh_import import FreshImports
from tests.helpers.import_forker import OURS

PACKAGES = ("omni_server", "omni_transport", "omni_client", "omni_bench")


def _modules() -> list[str]:
    names = []
    for package in PACKAGES:
        root = import_module(package)
        names.append(package)
        for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
            spec = importlib.util.find_spec(info.name)
            # __main__ runs a command line; the cffi-loaded C library is no Python module
            if info.name.endswith(".__main__") or not (spec and str(spec.origin).endswith(".py")):
                continue
            names.append(info.name)
    return sorted(names)


@pytest.fixture(scope="module")
def fresh() -> Iterator[FreshImports]:
    with FreshImports() as imports:
        yield imports


@pytest.mark.slow  # a forked child per module: a minute or two of imports for 230 modules
@pytest.mark.parametrize("module", _modules())
def test_module_imports_alone(fresh: FreshImports, module: str) -> None:
    error = fresh.error(module)
    assert error is None, f"import {module} failed:\n{error[-3000:]}"


def test_a_failing_import_is_reported_with_its_traceback(fresh: FreshImports) -> None:
    error = fresh.error("omni_server.no_such_module")
    assert error is not None and "ModuleNotFoundError" in error, error
    assert PACKAGES == OURS  # the forked child checks that none of these is loaded


# ---- the rooms' import directions (docs/architecture.md) ----------------------------------

SERVER = Path(__file__).resolve().parents[1] / "server"

# room -> rooms it must never import (a room is a package under omni_server, or one module)
FORBIDDEN = {
    "wire": {"pipeline", "stage", "serve", "gpu"},  # both sides import the wire
    "stage": {"pipeline", "serve"},  # a stage process never holds the server's side
    "pipeline": {"stage", "serve"},  # the stage room only through INLINE (below)
    "gpu": {"pipeline", "stage", "serve"},
    "compiler": {"pipeline", "stage", "serve", "wire", "gpu", "engine"},  # pure
    "engine": {"pipeline", "stage", "serve", "wire", "gpu", "compiler"},
    # plain-torch model code (Qwen3-Omni's parts): engine families build on it, never the reverse
    "models": {"pipeline", "stage", "serve", "wire", "gpu", "compiler", "engine"},
    "serve": {"stage", "wire", "gpu"},  # HTTP reaches the pipeline through Runtime
    # Ray Serve replicas reuse the server's app and Runtime; only the command line imports it
    "cluster": {"stage", "wire", "gpu", "engine"},
    # what stages hand each other: a leaf that the server builds and backends read
    "contracts": {"pipeline", "stage", "serve", "wire", "gpu", "engine"},
}
for _room_name, _forbidden in FORBIDDEN.items():
    if _room_name != "cluster":
        _forbidden.add("cluster")  # Ray is an extra: no room of the server depends on it
# the in-process pipeline: the one module of the pipeline room that imports the stage room
INLINE = "omni_server.pipeline.inline"


def _module_files() -> dict[str, Path]:
    files = {}
    for path in (SERVER / "omni_server").rglob("*.py"):
        parts = path.relative_to(SERVER).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _import_graph() -> dict[str, set[str]]:
    """Module -> the omni_server modules it imports: every import statement, at module level,
    in a function or under TYPE_CHECKING alike (a circle hidden in a function is still one).

    Importing `a.b.c` first runs the `__init__` of `a` and `a.b`: a module outside package
    `a.b` that imports from it depends on that package's `__init__` too (which may import the
    module back: a circle that only shows when the module is imported first)."""
    files = _module_files()
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parents = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parents, *([node.module] if node.module else [])])
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in files else base)
        targets = {m for m in found if m in files}
        for target in list(targets):
            parts = target.split(".")
            for n in range(2, len(parts)):
                package = ".".join(parts[:n])
                if package in files and not (module + ".").startswith(package + "."):
                    targets.add(package)
        graph[module] = targets - {module}
    return graph


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_no_import_circle_among_server_modules() -> None:
    try:
        tuple(graphlib.TopologicalSorter(_import_graph()).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"import circle: {' -> '.join(exc.args[1])}")


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_room_imports_run_one_way(room: str) -> None:
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in _import_graph().items()
        if _room(module) == room
        for target in targets
        if _room(target) in FORBIDDEN[room] and not (module == INLINE and _room(target) == "stage")
    )
    assert not wrong, "\n".join(wrong)


def test_the_inline_pipeline_is_the_one_module_importing_both_sides() -> None:
    both = sorted(
        module
        for module, targets in _import_graph().items()
        if {"pipeline", "stage"} <= {_room(t) for t in targets} | {_room(module)}
        and any(_room(t) == "stage" for t in targets)
        and _room(module) != "stage"
    )
    assert both == [INLINE], both


# ---- endpoints stand apart (docs/architecture.md) ----------------------------------------------

# endpoint -> its modules under omni_server.serve (a package: every module in it). What two
# endpoints share lives in a neutral serve module (validation, voice_catalog, multipart, ...) or
# in omni_server.contracts, never in one endpoint's module that another imports.
ENDPOINTS = {
    "speech": ("speech", "speech_request"),
    "chat": ("chat", "chat_request", "chat_body"),
    "transcription": ("transcription", "transcription_request", "transcription_format"),
    "voices": ("voices",),
    "speech_stream": ("speech_stream", "stream_settings"),
    "realtime": ("realtime",),
    "repository_api": ("repository_api",),
    "health": ("health",),
}
# the OpenAPI document describes every endpoint's body: the one module that imports them all
OPENAPI = "omni_server.serve.openapi"


def _endpoint(module: str) -> str | None:
    for endpoint, names in ENDPOINTS.items():
        for name in names:
            prefix = f"omni_server.serve.{name}"
            if module == prefix or module.startswith(prefix + "."):
                return endpoint
    return None


def test_no_endpoint_module_imports_another_endpoints_module() -> None:
    wrong = sorted(
        f"{module} ({_endpoint(module)}) imports {target} ({_endpoint(target)})"
        for module, targets in _import_graph().items()
        if _endpoint(module) is not None
        for target in targets
        if _endpoint(target) not in (None, _endpoint(module))
    )
    assert not wrong, "\n".join(wrong)


def test_every_endpoint_module_is_named() -> None:
    """A new endpoint module joins ENDPOINTS (or is a neutral helper on purpose): the rule
    above only holds for what it knows."""
    assert all(_endpoint(f"omni_server.serve.{n}") for names in ENDPOINTS.values() for n in names)
    assert _endpoint(OPENAPI) is None


# ---- backends read typed contracts (docs/backends.md) -------------------------------------------

ROOT = SERVER.parent
BACKENDS = sorted([*ROOT.glob("repository/*/model.py"), *ROOT.glob("examples/*/*/model.py")])
# what a stage backend may import of the server: the stage-author API, the contracts, and the
# libraries for stage authors (audio, engine, the compiled plan's types, the plain-torch model
# code an example's stages run: models/qwen3_omni)
BACKEND_SURFACE = ("backend", "contracts", "audio", "engine", "compiler", "models")
# the backends that read an API contract -> the contracts they read, and the fields that exist
# only in those contracts: reading one by its name out of a dict is parsing the contract again
CONTRACT_READERS = {
    "repository/text_frontend/model.py": ("SpeechOptions",),
    "repository/acoustic/model.py": ("SpeechOptions",),
    "repository/audio_encoder/model.py": ("SpeechOptions",),
    "repository/thinker/model.py": ("ChatInput",),
    "repository/asr_whisper/model.py": ("AsrOptions",),
    "examples/higgs-audio-v2/preprocessing/model.py": ("SpeechOptions",),
    "examples/qwen3-omni/preprocessing/model.py": ("ChatInput",),
    "examples/qwen3-omni/thinker/model.py": ("ChatInput",),
    "examples/qwen3-omni/code2wav/model.py": ("SpeechOptions",),
}
CONTRACT_ONLY_FIELDS = {
    "SpeechOptions": {"speed", "response_format", "reference", "instructions"},
    "ChatInput": {"messages", "max_tokens", "top_p", "top_k", "min_p", "stop"},
    "AsrOptions": {"prompt", "words"},
}


def _server_imports(tree: ast.AST) -> list[tuple[str, set[str]]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("omni_server"):
            found.append((node.module or "", {alias.name for alias in node.names}))
        elif isinstance(node, ast.Import):
            found += [(a.name, set()) for a in node.names if a.name.startswith("omni_server")]
    return found


def _literal_reads(tree: ast.AST) -> set[str]:
    """Names read out of a mapping by a literal: `x["name"]` (not a store) or `x.get("name")`."""
    reads = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
        ):
            key = node.args[0]
        else:
            continue
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            reads.add(key.value)
    return reads


@pytest.mark.parametrize("path", BACKENDS, ids=lambda p: str(p.relative_to(ROOT)))
def test_backends_import_only_the_stage_author_surface(path: Path) -> None:
    tree = ast.parse(path.read_text())
    wrong = [
        module
        for module, _ in _server_imports(tree)
        if module.split(".")[1:2] and module.split(".")[1] not in BACKEND_SURFACE
    ]
    assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}"


@pytest.mark.parametrize("name", sorted(CONTRACT_READERS))
def test_backends_read_the_api_contracts_typed(name: str) -> None:
    tree = ast.parse((ROOT / name).read_text())
    imported = {n for module, names in _server_imports(tree) if module == "omni_server.contracts"
                for n in names}  # fmt: skip
    contracts = CONTRACT_READERS[name]
    assert set(contracts) <= imported, f"{name} reads {contracts} from omni_server.contracts"
    reparsed = _literal_reads(tree) & set().union(*(CONTRACT_ONLY_FIELDS[c] for c in contracts))
    assert not reparsed, f"{name} reads the contract's {sorted(reparsed)} out of a dict"
