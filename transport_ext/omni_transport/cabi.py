"""The C library's binding, for tests of the C contract (omni_transport.h) and nothing else.

`lib` calls libomni_transport.so as the header declares it and `ffi` allocates its types: the
very objects `Ring`, the regions and the CUDA pools run on. Code that moves data uses those
classes, which own the handles; this module hands them out raw so that a test can call a C
function on a live ring and check what the header promises (return codes, doorbells).
"""

from __future__ import annotations

from typing import Any

from omni_transport._ffi import ABI_VERSION, ffi, lib
from omni_transport.ring import Record, Ring

__all__ = ["ABI_VERSION", "ffi", "lib", "record_end", "ring_handle"]


def ring_handle(ring: Ring) -> Any:
    """`ring`'s `omni_ring *`, valid until `ring.close()` (raises RingError after it)."""
    return ring._handle()


def record_end(record: Record) -> int:
    """The ring position just past `record`: what `omni_ring_release` takes to hand it back."""
    return record._end
