"""cffi (ABI mode) binding of libomni_transport.so.

The declarations are the C header itself (`omni_transport.h`), read at import: the API, the
error codes and the `omni_record` layout are written once, in C. The header sits next to this
file in an installed package and in `transport_ext/include` in a source checkout.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path
from typing import Any

import cffi

_HEADER = "omni_transport.h"
_INT_DEFINE = re.compile(r"#define\s+\w+\s+\d+\s*(/\*.*\*/)?\s*$")


def _header_path() -> Path:
    here = Path(__file__).resolve().parent
    for path in (here / _HEADER, here.parent / "include" / _HEADER):
        if path.is_file():
            return path
    raise ImportError(f"{_HEADER} not found next to {here} nor in ../include: reinstall")


def _cdef_source(text: str) -> str:
    """The header as cffi's parser takes it: integer #defines kept, other preprocessor lines
    and the OMNI_API visibility marker dropped."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)  # comments (they may span lines)
    lines = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            if _INT_DEFINE.match(stripped):
                lines.append(stripped)
            continue
        lines.append(re.sub(r"\bOMNI_API\b", "", line))
    return "\n".join(lines)


_SOURCE = _header_path().read_text()
ffi = cffi.FFI()
ffi.cdef(_cdef_source(_SOURCE))
# the version this binding was written against: the header's, so it cannot drift from it
ABI_VERSION = int(re.search(r"#define\s+OMNI_ABI_VERSION\s+(\d+)", _SOURCE).group(1))  # type: ignore[union-attr]


def _library_candidates() -> list[Path]:
    # A source checkout (or a regular install) has the library next to this file; an editable
    # install maps the Python files to the source tree while the library stays in site-packages,
    # where the distribution's file list finds it.
    here = Path(__file__).resolve().parent
    found = sorted(here.glob("libomni_transport*.so"))
    try:
        files = metadata.files("omni-server") or []
    except metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if entry.name.startswith("libomni_transport") and entry.name.endswith(".so"):
            found.append(Path(entry.locate()).resolve())
    return found


def _load() -> Any:
    here = Path(__file__).resolve().parent
    candidates = _library_candidates()
    if not candidates:
        raise ImportError(
            f"libomni_transport.so not found next to {here}: install the package with "
            "`pip install .` or build it with `cmake -S . -B build && cmake --build build`"
        )
    # A stale build (say, an editable install's, older than a dev build) is skipped, not used.
    seen = []
    for path in candidates:
        lib = ffi.dlopen(str(path))
        found = lib.omni_transport_abi_version()
        if found == ABI_VERSION:
            return lib
        seen.append(f"{path} (ABI {found})")
    raise ImportError(
        f"libomni_transport ABI {ABI_VERSION} needed, found only {', '.join(seen)}: rebuild it "
        "(`cmake -S . -B build/dev && cmake --build build/dev`, or reinstall the package)"
    )


lib = _load()
