"""Tests read as documentation of what the code promises, so they use its public names: no test
reaches into a private attribute (`obj._x`) or imports a private module or name of ours
(`omni_transport._ffi`, `from omni_server.x import _y`). What a test needs to observe gets a
small, documented seam in the code instead (`StageNode.holds`, `omni_transport.cabi`, ...).

`self._x` and `cls._x` are a class's own state and stay allowed, as are the few underscore names
that are public API elsewhere (namedtuple's `_replace`, `sys._getframe`, ...).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
OURS = ("omni_server", "omni_transport", "omni_client", "omni_bench")

# Public despite the underscore: namedtuple's API, and the standard library's documented ones.
PUBLIC_UNDERSCORED = {"_replace", "_asdict", "_fields", "_make", "_getframe", "_exit"}

# (file under tests/, name) -> why it may stay. Keep it short: each entry is a seam still owed.
ALLOWED: dict[tuple[str, str], str] = {}  # (test file, name) -> why it may stay


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in PUBLIC_UNDERSCORED


def _ours(module: str) -> bool:
    return module.split(".")[0] in OURS


def private_uses(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every private attribute, module or imported name `path` uses."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append((node.lineno, node.attr))
        elif isinstance(node, ast.ImportFrom) and node.module and _ours(node.module):
            found += [(node.lineno, p) for p in node.module.split(".") if _private(p)]
            found += [(node.lineno, a.name) for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name):
                    found += [(node.lineno, p) for p in alias.name.split(".") if _private(p)]
    return found


def test_no_test_reaches_into_private_names():
    offences, used = [], set()
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        for line, name in private_uses(path):
            if (rel, name) in ALLOWED:
                used.add((rel, name))
            else:
                offences.append(f"tests/{rel}:{line}: {name}")
    assert not offences, "private names used by tests (add a public seam):\n" + "\n".join(offences)
    assert used == ALLOWED.keys(), f"allow-list entries no longer needed: {ALLOWED.keys() - used}"


def test_the_check_sees_each_kind_of_private_use(tmp_path):
    """The walk above would pass vacuously if it saw nothing: each kind is caught."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from omni_transport._ffi import lib\n"
        "from omni_server.gpu.mps import _kill\n"
        "import omni_transport._ffi\n"
        "handle._key\n"
        "self._fine, cls._fine, point._replace, sys._getframe, obj.__dict__\n"
    )
    assert sorted(private_uses(sample)) == [(1, "_ffi"), (2, "_kill"), (3, "_ffi"), (4, "_key")]
