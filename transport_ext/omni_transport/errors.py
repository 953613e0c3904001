"""Exceptions of the transport, one per outcome a caller handles differently."""

from __future__ import annotations

from omni_transport._ffi import ffi, lib


class TransportError(Exception):
    """Base of every omni_transport error."""


class RingError(TransportError):
    """A ring operation failed (bad name, not a ring, role already taken, system call)."""


class RingClosed(RingError):
    """The peer closed the ring or died; a consumer gets it only after the last record."""


class RingFull(RingError):
    """push(timeout=0) found no room: the caller chose to be refused rather than wait."""


class SegmentRefused(RingError):
    """attach refused a segment: not one of this version and kind, not this user's (or open to
    others), or a header that does not match the file."""


class RingCorrupt(RingError):
    """A counter or record read from the ring's shared memory failed validation: something
    other than the producer wrote there. The record is not handed out."""


class RingTimeout(RingError, TimeoutError):
    """The timeout of a blocking push or pop passed."""


class RecordTooLarge(RingError, ValueError):
    """The record is larger than the ring's capacity: it can never be pushed."""


class CudaUnavailable(TransportError, RuntimeError):
    """The CUDA driver library (libcuda.so.1) could not be loaded, or no device is usable."""


class CudaError(TransportError, RuntimeError):
    """A CUDA driver call failed."""


_BY_CODE: dict[int, type[TransportError]] = {
    lib.OMNI_EFULL: RingFull,
    lib.OMNI_ETIMEOUT: RingTimeout,
    lib.OMNI_ECLOSED: RingClosed,
    lib.OMNI_ETOOLARGE: RecordTooLarge,
    lib.OMNI_EFORMAT: SegmentRefused,
    lib.OMNI_ECORRUPT: RingCorrupt,
    lib.OMNI_ENOCUDA: CudaUnavailable,
    lib.OMNI_ECUDA: CudaError,
}


def error_for(code: int) -> TransportError:
    """The exception for a C return code, with the library's thread-local message."""
    message = ffi.string(lib.omni_last_error()).decode(errors="replace")
    return _BY_CODE.get(code, RingError)(message or f"omni_transport error {code}")


def check(code: int) -> None:
    if code != lib.OMNI_OK:
        raise error_for(code)
