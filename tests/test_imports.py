"""Every module of every package imports alone, in a fresh interpreter: no import cycle hides
behind the order in which other modules happened to be imported first."""

from __future__ import annotations

import importlib.util
import pkgutil
import subprocess
import sys
from importlib import import_module

import pytest

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


@pytest.mark.slow  # one fresh interpreter per module: seconds each where torch is imported
@pytest.mark.parametrize("module", _modules())
def test_module_imports_alone(module: str) -> None:
    run = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, f"import {module} failed:\n{run.stderr[-3000:]}"
