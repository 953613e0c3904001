"""omni_transport: the native data plane between stage processes.

- Ring: a named shared-memory SPSC ring, one per edge direction (omni_transport.ring).
- push_arrays / record_arrays: numpy arrays through a ring, zero-copy on the read side.
- CudaPool / CudaReceiver / TensorRecord: CUDA tensors across processes through an exported
  device pool (omni_transport.cuda_ipc).

These exports are the public API; the modules inside may change.
"""

from omni_transport._ffi import ABI_VERSION, lib
from omni_transport.arrays import push_arrays, record_arrays
from omni_transport.cuda_ipc import CudaPool, CudaReceiver, TensorRecord
from omni_transport.errors import (
    CudaError,
    CudaUnavailable,
    RecordTooLarge,
    RingClosed,
    RingCorrupt,
    RingError,
    RingFull,
    RingTimeout,
    SegmentRefused,
    TransportError,
)
from omni_transport.ring import Record, Ring, unique_name, unlink_leftovers

__all__ = [
    "ABI_VERSION",
    "CudaError",
    "CudaPool",
    "CudaReceiver",
    "CudaUnavailable",
    "Record",
    "RecordTooLarge",
    "Ring",
    "RingClosed",
    "RingCorrupt",
    "RingError",
    "RingFull",
    "RingTimeout",
    "SegmentRefused",
    "TensorRecord",
    "TransportError",
    "abi_version",
    "push_arrays",
    "record_arrays",
    "unique_name",
    "unlink_leftovers",
]


def abi_version() -> int:
    """The ABI version reported by the loaded C library."""
    return int(lib.omni_transport_abi_version())
