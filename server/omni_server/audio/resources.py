"""Finding model files shipped inside installed Python packages (never a path on one machine)."""

from __future__ import annotations

import importlib.resources
from pathlib import Path


def package_files(package: str, suffix: str) -> list[Path]:
    """Every file under the installed `package` whose name ends with `suffix`, sorted.

    Raises ValueError naming the package when it is not installed.
    """
    try:
        root = importlib.resources.files(package)
    except ModuleNotFoundError as err:
        raise ValueError(f"package {package!r} is not installed (pip install it)") from err
    # Wheels unpack to real directories; a zipped package would need as_file() per file.
    return sorted(p for p in Path(str(root)).rglob(f"*{suffix}") if p.is_file())


def package_file(package: str, suffix: str) -> Path:
    """The one file under `package` ending with `suffix`; ValueError if none or several."""
    found = package_files(package, suffix)
    if len(found) != 1:
        names = ", ".join(p.name for p in found) or "none"
        raise ValueError(f"package {package!r} must ship exactly one *{suffix} file; found {names}")
    return found[0]
