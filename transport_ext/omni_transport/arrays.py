"""numpy arrays through a ring: one copy in (the push), zero copies out.

A record made by push_arrays carries, after the caller's header, a first buffer describing the
arrays (dtype and shape of each) and then one buffer per array. Buffers start on 64-byte
boundaries in the ring, so every dtype is aligned."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from omni_transport.ring import Record, Ring


def push_arrays(
    ring: Ring, header: bytes, arrays: Sequence[np.ndarray], timeout: float | None = None
) -> None:
    """Pushes header and arrays as one record (non-contiguous arrays are made contiguous)."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    for a in arrays:
        if a.dtype.hasobject:
            raise TypeError(f"array of dtype {a.dtype}: object arrays cannot cross a ring")
    meta = json.dumps([[a.dtype.str, list(a.shape)] for a in arrays]).encode()
    ring.push(header, [meta, *arrays], timeout=timeout)


def record_arrays(rec: Record) -> list[np.ndarray]:
    """Read-only numpy views over a record made by push_arrays; valid until rec.release()."""
    if not rec.buffers:
        raise ValueError("record has no array descriptor: it was not made by push_arrays")
    # the descriptor comes from shared memory: every part of it is checked (a ValueError
    # otherwise), and no dtype may hold Python objects
    try:
        meta = json.loads(bytes(rec.buffers[0]))
        if not isinstance(meta, list) or len(meta) != len(rec.buffers) - 1:
            raise ValueError(f"describes {len(meta)} arrays, holds {len(rec.buffers) - 1}")
        out = []
        for (dtype, shape), buf in zip(meta, rec.buffers[1:], strict=True):
            dt = np.dtype(dtype)
            if dt.hasobject:
                raise ValueError(f"dtype {dt} holds Python objects")
            out.append(np.frombuffer(buf, dtype=dt).reshape(shape))
    except (TypeError, ValueError) as e:
        raise ValueError(f"record is not an array record of push_arrays: {e}") from None
    return out
