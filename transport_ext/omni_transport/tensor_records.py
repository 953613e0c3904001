"""The one-tensor record (tensor_record.c): a message that is one CUDA tensor of an exported
pool, encoded and checked in C, and the DLPack view the receiver hands on.

Encoding and decoding need no GPU (the layout and its checks are tested on the CPU); the view
is a DLPack capsule that torch takes with `torch.from_dlpack` without copying, whose deleter
(run when the last tensor sharing its storage is freed) gives the pool's block back.
"""

from __future__ import annotations

import ctypes
from typing import Any

from omni_transport._ffi import ffi, lib
from omni_transport.errors import TransportError

# torch dtype name -> the record's dtype code (omni_transport.h: OMNI_TREC_DTYPES)
DTYPE_CODES = {
    name: code
    for code, name in enumerate(
        (
            "bool",
            "uint8",
            "int8",
            "int16",
            "int32",
            "int64",
            "uint16",
            "uint32",
            "uint64",
            "float16",
            "bfloat16",
            "float32",
            "float64",
            "complex64",
            "complex128",
        )
    )
}
MAX_DIMS = lib.OMNI_TREC_MAX_DIMS
NAME_MAX = lib.OMNI_TREC_NAME_MAX
REQUIRES_GRAD = lib.OMNI_TREC_REQUIRES_GRAD
KEYED = lib.OMNI_TREC_KEYED
_MAGIC = b"OTR1"


class BadRecord(TransportError, ValueError):
    """Bytes that are not a well-formed tensor record, or one that names no block of its pool."""


def _failed() -> BadRecord:
    return BadRecord(ffi.string(lib.omni_last_error()).decode(errors="replace"))


def is_record(data: bytes | memoryview) -> bool:
    """The bytes start like a tensor record (pickled messages never do)."""
    return bytes(data[:4]) == _MAGIC


def new() -> Any:
    """An empty record struct (reuse one per side: no allocation per message)."""
    return ffi.new("omni_trec *")


def set_name(rec: Any, field: str, name: str) -> None:
    raw = name.encode()
    if len(raw) > NAME_MAX:
        raise BadRecord(f"{field} name of {len(raw)} bytes (at most {NAME_MAX})")
    setattr(rec, field, raw + b"\0")


def encode(rec: Any, out: Any, length: Any) -> bytes:
    """The record's bytes; `out` a char buffer of at least record_bytes(MAX_DIMS), `length` a
    uint64_t *. BadRecord for a record the C checks refuse."""
    if lib.omni_trec_encode(rec, out, len(out), length) != lib.OMNI_OK:
        raise _failed()
    return ffi.buffer(out, length[0])[:]


def record_bytes(ndim: int) -> int:
    return 168 + 16 * ndim + 2 * NAME_MAX


def decode(data: bytes | memoryview, rec: Any) -> tuple[str, str]:
    """Parses and checks `data` into `rec`: its (pool, key); BadRecord naming what is off."""
    if lib.omni_trec_decode(ffi.from_buffer(data), len(data), rec) != lib.OMNI_OK:
        raise _failed()
    return names(rec)


def names(rec: Any) -> tuple[str, str]:
    """(pool, key) of a decoded record; BadRecord for a key that is not UTF-8."""
    try:
        return ffi.string(rec.pool).decode("ascii"), ffi.string(rec.key).decode()
    except UnicodeDecodeError:
        raise BadRecord("tensor record: its key is not UTF-8") from None


def fields(rec: Any) -> dict[str, Any]:
    """The record as plain values (tests, diagnostics)."""
    n = rec.ndim
    return {
        "device": rec.device,
        "slot": rec.slot,
        "offset": rec.offset,
        "nbytes": rec.nbytes,
        "dtype": list(DTYPE_CODES)[rec.dtype],
        "shape": tuple(rec.shape[0:n]),
        "strides": tuple(rec.strides[0:n]),
        "flags": rec.flags,
        "pool": names(rec)[0],
        "key": names(rec)[1],
        "mem_handle": bytes(ffi.buffer(rec.mem_handle)),
        "event_handle": bytes(ffi.buffer(rec.event_handle)),
    }


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
_DLTENSOR = b"dltensor"


def view(rec: Any, data: int, *, cuda: bool, stream: int, state: Any, live: Any) -> Any:
    """The tensor the record describes over `data` (+ its offset), without a copy: torch owns
    a DLPack view whose deleter stores 0 to `state` (the slot's word; on CUDA once the work
    queued on `stream` is done) when the storage is freed, and counts down `live`."""
    out = ffi.new("void **")
    if lib.omni_trec_view(rec, data, int(cuda), stream, state, live, out) != lib.OMNI_OK:
        raise _failed()
    return take(out[0])


def take(view: Any) -> Any:
    """The torch tensor over a DLPack view made by the C library (omni_trec_view or
    omni_trec_accept); the view is freed (its block given back) if torch does not take it."""
    import torch

    try:
        # no destructor: torch takes the capsule at once and calls the deleter itself
        capsule = _capsule_new(int(ffi.cast("uintptr_t", view)), _DLTENSOR, None)
        return torch.from_dlpack(capsule)
    except BaseException:
        lib.omni_trec_view_free(view)
        raise
