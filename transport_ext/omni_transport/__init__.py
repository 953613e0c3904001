"""omni_transport: the native data plane between stage processes (shared-memory rings, CUDA IPC)."""

from omni_transport._ffi import ABI_VERSION, lib

__all__ = ["ABI_VERSION", "abi_version"]


def abi_version() -> int:
    """The ABI version reported by the loaded C library."""
    return int(lib.omni_transport_abi_version())
