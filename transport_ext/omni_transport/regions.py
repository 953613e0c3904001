"""Regions: memory one process fills once and other processes of this user map for good.

What the ring and the CUDA pool move are messages: a block is lent and comes back. A region
is the other case, long-lived tensors one owner writes once and many readers alias (the
runtime's shared weights, server/omni_server/gpu/weights.py):

- HostRegion: a named shared-memory segment (omni_transport segment, mode 0600, its owner in
  the segment's user table, so a dead owner's region is a leftover that unlink_leftovers
  removes). Readers map the file read-only (HostRegionView): a write through their tensors
  faults instead of changing the owner's weights.
- CudaRegion: a device allocation exported through the CUDA IPC handle exchange of
  cuda_ipc (the pool segment layout with one slot). Readers open the handle (CudaRegionView);
  CUDA has no read-only mapping, so read-only is a contract there.

The owner decides the layout: `place(tensor) -> offset` copies one tensor in; it publishes the
offsets however it likes. A reader trusts none of them: `tensor(offset, nbytes, dtype, shape)`
checks the block lies inside the region, the dtype is one of cuda_ipc's whitelist and the
shape fills exactly nbytes (BadTensorRecord otherwise), and the view opens only a regular file
of this user with no access for others, of the size the reader was told.

Order: readers close (or exit) before the owner frees a CudaRegion: a reader's mapping of
freed device memory is undefined. A HostRegion's pages live until the last mapping goes.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import warnings
from typing import Any

from omni_transport._ffi import ffi, lib
from omni_transport.cuda_ipc import (  # the pool's layout and checks, shared on purpose
    _ALIGN,
    _DTYPES,
    _HANDLE,
    BadTensorRecord,
    PoolSegment,
    _OpenPool,
    _pool_bytes,
    _require_cuda,
    _tensor_in,
    _torch,
)
from omni_transport.errors import check

PAGE = mmap.PAGESIZE  # a segment's data starts one page into its file (segment.c)


def _aligned(nbytes: int) -> int:
    return (max(nbytes, 1) + _ALIGN - 1) // _ALIGN * _ALIGN


def region_bytes(tensors: Any) -> int:
    """The bytes a region needs for these tensors, each on its own 512-byte boundary."""
    return sum(_aligned(t.numel() * t.element_size()) for t in tensors)


def check_block(size: int, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> None:
    """A block [offset, +nbytes) of a region of `size` bytes holding `shape` of `dtype`."""
    if offset % _ALIGN or offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise BadTensorRecord(
            f"block [{offset}, +{nbytes}) is not inside the region's {size} bytes"
        )
    if dtype not in _DTYPES or not hasattr(_torch(), dtype):
        raise BadTensorRecord(f"dtype {dtype!r} is not a tensor dtype")
    if not all(type(d) is int and d >= 0 for d in shape):
        raise BadTensorRecord(f"shape {shape!r} is not a tuple of sizes")
    itemsize = _torch().empty((), dtype=getattr(_torch(), dtype)).element_size()
    if math.prod(shape) * itemsize != nbytes:
        raise BadTensorRecord(f"shape {shape} of {dtype} is not {nbytes} bytes")


def _dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


class _Placer:
    """The owner's bump allocation: tensors copied in one after the other."""

    size: int
    address: int  # where the region starts in this process
    _next: int = 0

    def contains(self, address: int) -> bool:
        """Whether `address` (a tensor's data_ptr) lies inside the region."""
        return self.address <= address < self.address + self.size

    def _claim(self, nbytes: int) -> int:
        offset = self._next
        if offset + nbytes > self.size:
            raise ValueError(f"region of {self.size} bytes is full ({nbytes} more bytes asked)")
        self._next = offset + _aligned(nbytes)
        return offset


# ---- host memory -----------------------------------------------------------------------------


class HostRegion(_Placer):
    """Owner side, host memory: a segment of `nbytes` (rounded up to pages)."""

    def __init__(self, name: str, nbytes: int) -> None:
        out = ffi.new("omni_segment **")
        check(lib.omni_segment_create(name.encode(), max(nbytes, 1), out))
        self._seg = out[0]
        self.name = name
        self.size = int(lib.omni_segment_size(self._seg))
        self._buffer = ffi.buffer(lib.omni_segment_data(self._seg), self.size)
        self.address = int(ffi.cast("uintptr_t", lib.omni_segment_data(self._seg)))

    def place(self, tensor: Any) -> tuple[int, Any]:
        """Copy a CPU tensor in: (its offset, the tensor viewing the region)."""
        nbytes = tensor.numel() * tensor.element_size()
        offset = self._claim(nbytes)
        view = _host_tensor(self._buffer, offset, nbytes, _dtype_name(tensor), tuple(tensor.shape))
        view.copy_(tensor)
        return offset, view

    def close(self) -> None:
        """Unmaps the region (the name goes with its last user): tensors made by place() must
        not be used any more."""
        if self._seg is not None:
            self._buffer = None
            lib.omni_segment_close(self._seg)
            self._seg = None


class HostRegionView:
    """Reader side, host memory: the region `name` of `nbytes` data bytes, mapped read-only."""

    def __init__(self, name: str, nbytes: int) -> None:
        if "/" in name or name.startswith("."):
            raise BadTensorRecord(f"region name {name!r} is not a segment name")
        self.size = (max(nbytes, 1) + PAGE - 1) // PAGE * PAGE
        fd = os.open(f"/dev/shm/{name}", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise BadTensorRecord(
                    f"/dev/shm/{name}: not a regular file of this user with mode 0600: refused"
                )
            if st.st_size != PAGE + self.size:
                raise BadTensorRecord(
                    f"/dev/shm/{name}: {st.st_size} bytes, expected {PAGE + self.size}"
                )
            self._map: mmap.mmap | None = mmap.mmap(
                fd, PAGE + self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ
            )
        finally:
            os.close(fd)
        self.name = name
        self._data = memoryview(self._map)[PAGE:]
        self.address = int(ffi.cast("uintptr_t", ffi.from_buffer(self._data)))

    def tensor(self, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> Any:
        """A read-only tensor viewing a checked block of the region (no copy)."""
        check_block(self.size, offset, nbytes, dtype, shape)
        return _host_tensor(self._data, offset, nbytes, dtype, shape)

    def contains(self, address: int) -> bool:
        """Whether `address` (a tensor's data_ptr) lies inside this mapping."""
        return self.address <= address < self.address + self.size

    def close(self) -> None:
        """Drops this view's mapping once no tensor of it is left (the pages stay mapped until
        then: unmapping under a live tensor would fault)."""
        if self._map is not None:
            try:
                self._data.release()
                self._map.close()
            except BufferError:  # tensors still view it: their pages go with the last of them
                pass
            self._map = None


def _host_tensor(buffer: Any, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> Any:
    torch = _torch()
    if nbytes == 0:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    with warnings.catch_warnings():  # a read-only view is the point: the warning says so
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(getattr(torch, dtype)).view(shape)


# ---- device memory ---------------------------------------------------------------------------


class CudaRegion(_Placer):
    """Owner side, device memory: one exported allocation of `nbytes` on `device`. Its segment
    has cuda_ipc's pool layout with one slot, so a reader opens it like a pool."""

    def __init__(self, name: str, nbytes: int, *, device: int) -> None:
        _require_cuda()
        torch = _torch()
        torch.cuda.set_device(device)
        torch.cuda.current_stream()  # torch's primary context current on this thread
        self.name = name
        self.device = device
        self.size = _aligned(nbytes)
        out = ffi.new("omni_segment **")
        check(lib.omni_segment_create(name.encode(), PoolSegment.size(1), out))
        self._seg: Any = out[0]
        self._dptr = 0
        try:
            p = ffi.new("uint64_t *")
            check(lib.omni_cuda_mem_alloc(self.size, p))
            self._dptr = int(p[0])
            base = lib.omni_segment_data(self._seg)
            check(lib.omni_cuda_ipc_get_mem_handle(self._dptr, base))
            ffi.cast("uint64_t *", base + _HANDLE)[0] = self.size
            ffi.cast("uint32_t *", base + _HANDLE + 8)[0:2] = [device, 1]
        except BaseException:
            if self._dptr:
                lib.omni_cuda_mem_free(self._dptr)
            lib.omni_segment_close(self._seg)
            raise
        self._bytes: Any = _pool_bytes(self._dptr, self.size)
        self.address = self._dptr

    def place(self, tensor: Any) -> tuple[int, Any]:
        """Copy a tensor in (device to device, or host to device): (offset, the view)."""
        nbytes = tensor.numel() * tensor.element_size()
        offset = self._claim(nbytes)
        view = _tensor_in(self._bytes, offset, nbytes, _dtype_name(tensor), tuple(tensor.shape))
        view.copy_(tensor)
        return offset, view

    def close(self) -> None:
        """Frees the allocation and its name. Readers must have closed their views first."""
        if self._dptr:
            self._bytes = None
            lib.omni_cuda_mem_free(self._dptr)
            self._dptr = 0
            lib.omni_segment_close(self._seg)


class CudaRegionView:
    """Reader side, device memory: the region `name`, opened through its IPC handle once."""

    def __init__(self, name: str, *, device: int) -> None:
        torch = _torch()
        torch.cuda.set_device(device)
        torch.cuda.current_stream()  # torch's primary context current on this thread
        self._pool: _OpenPool | None = _OpenPool(name)
        if self._pool.shared.device != device:
            found = self._pool.shared.device
            self.close()
            raise BadTensorRecord(f"region {name!r} is on device {found}, not {device}")
        self.name = name
        self.size = self._pool.shared.nbytes
        self.address = self._pool.dptr  # where the owner's allocation is mapped here

    def tensor(self, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> Any:
        """A tensor aliasing a checked block of the owner's allocation (no copy)."""
        assert self._pool is not None, "the view is closed"
        check_block(self.size, offset, nbytes, dtype, shape)
        return _tensor_in(self._pool.bytes, offset, nbytes, dtype, shape)

    def contains(self, address: int) -> bool:
        return self.address <= address < self.address + self.size

    def close(self) -> None:
        """Closes the mapping: tensors made by tensor() must not be used any more."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
