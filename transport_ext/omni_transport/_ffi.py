"""cffi (ABI mode) binding of libomni_transport.so.

The C declarations below mirror transport_ext/include/omni_transport.h.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import cffi

ABI_VERSION = 1

ffi = cffi.FFI()
ffi.cdef(
    """
    uint32_t omni_transport_abi_version(void);
    """
)


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


def _load():
    here = Path(__file__).resolve().parent
    candidates = _library_candidates()
    if not candidates:
        raise ImportError(
            f"libomni_transport.so not found next to {here}: install the package with "
            "`pip install .` or build it with `cmake -S . -B build && cmake --build build`"
        )
    lib = ffi.dlopen(str(candidates[0]))
    found = lib.omni_transport_abi_version()
    if found != ABI_VERSION:
        raise ImportError(f"libomni_transport ABI {found}, expected {ABI_VERSION}: rebuild it")
    return lib


lib = _load()
