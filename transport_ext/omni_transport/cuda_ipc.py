"""CUDA tensors across processes on one GPU, without copies and without a handle per tensor.

The producer exports one device pool once (CudaPool). A tensor allocated in the pool crosses as
a small TensorRecord (pool, slot, offset, nbytes, dtype, shape); the consumer (CudaReceiver)
opens the pool's memory handle once and caches it, waits on the producer's event for that slot
on its own stream, and returns a tensor viewing the pool. The producer reuses a block only after
the consumer released it.

Shared state of a pool, in a named segment (omni_transport segment, mode 0600):

    offset 0     memory handle of the pool (64 B)
    offset 64    pool size (u64), device ordinal (u32), slot count (u32)
    offset 128   slot state, u32 per slot: 1 = in flight (producer stored it, release order,
                 before pushing the record), 2 = opened (a consumer of a packed record took it:
                 a replay is refused), 0 = free (consumer stored it, release order, after its
                 GPU work on the tensor finished)
    after that   IPC event handle per slot (64 B each), written by the producer before the
                 slot is first used

Producer side: CudaPool (one thread). Consumer side: CudaReceiver (one thread).
Without a CUDA driver every entry point raises CudaUnavailable.

Nothing read from the segment or a record is trusted: the pool's size and slot count are checked
against the segment, and a record's slot, offset, size, dtype and shape against the pool before
a tensor is made (BadTensorRecord). A producer waiting for blocks stops when the consumer that
holds them is gone (PoolClosed) instead of waiting forever.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omni_transport import tensor_records as _trec
from omni_transport._ffi import ffi, lib
from omni_transport.errors import CudaUnavailable, TransportError, check, error_for
from omni_transport.ring import Record, Ring

_HANDLE = 64
_META = 64
_STATES = 128
_ALIGN = 512  # every block starts on a 512-byte boundary of the pool


class PoolFull(TransportError):
    """No free block of the pool before the timeout: the consumer holds too much."""


class PoolClosed(PoolFull):
    """The consumer holding the pool's blocks died or left: they will never come back."""


class BadTensorRecord(TransportError, ValueError):
    """A tensor record (or the pool segment it names) that does not describe a block of the
    pool: refused before any tensor is made from it."""


# the dtypes a record may name (a name is looked up on torch: it must not reach anything else)
_DTYPES = frozenset(
    {
        "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2",
    }
)  # fmt: skip
_MAX_DIMS = 64
_VIEW_CACHE = 256  # views of an opened pool kept for reuse (the receiver's open())


def cuda_available() -> bool:
    """True when the CUDA driver loads and a context can be made current."""
    return bool(lib.omni_cuda_available())


def _require_cuda() -> None:
    if not lib.omni_cuda_available():
        raise CudaUnavailable(ffi.string(lib.omni_last_error()).decode(errors="replace"))


def _torch() -> Any:
    import torch  # imported lazily: the ring does not need torch

    return torch


@dataclass(frozen=True)
class TensorRecord:
    """What crosses the ring for one tensor (about 100 bytes of JSON)."""

    pool: str
    slot: int
    offset: int
    nbytes: int
    dtype: str  # torch dtype name, e.g. "float16"
    shape: tuple[int, ...]

    def to_bytes(self) -> bytes:
        return json.dumps(
            [self.pool, self.slot, self.offset, self.nbytes, self.dtype, list(self.shape)]
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> TensorRecord:
        """Parses and type-checks a record (its values are checked against the pool by
        CudaReceiver.open)."""
        try:
            pool, slot, offset, nbytes, dtype, shape = json.loads(bytes(data))
        except (ValueError, TypeError) as e:
            raise BadTensorRecord(f"not a tensor record: {e}") from None
        ints = [slot, offset, nbytes, *shape] if isinstance(shape, list) else None
        if (
            not isinstance(pool, str)
            or not isinstance(dtype, str)
            or ints is None
            or len(shape) > _MAX_DIMS
            or not all(type(v) is int and v >= 0 for v in ints)
        ):
            raise BadTensorRecord(f"malformed tensor record {bytes(data)[:200]!r}")
        return cls(pool, slot, offset, nbytes, dtype, tuple(shape))


class _CudaMemory:
    """__cuda_array_interface__ over raw device bytes. It does not own them: tensors made from
    a pool are valid until the pool (producer) or the receiver (consumer) is closed."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }


def _pool_bytes(ptr: int, nbytes: int) -> Any:
    """The whole pool as one uint8 CUDA tensor, made once per pool and process."""
    return _torch().as_tensor(_CudaMemory(ptr, nbytes), device="cuda")


def _tensor_in(pool: Any, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> Any:
    # bytes -> dtype: works for every dtype, bfloat16 included (which the interface lacks);
    # slicing the cached pool tensor costs microseconds, a new interface object far more
    return pool[offset : offset + nbytes].view(getattr(_torch(), dtype)).view(shape)


_raw_stream: Any = None  # (current device, raw current stream) accessors, found on first use


def _stream() -> int:
    """This thread's current CUDA stream, as the driver's handle.

    `torch.cuda.current_stream()` costs tens of microseconds a call (device-index resolution, a
    Stream object), a large share of a crossing; torch's C accessors for the raw stream (those
    its compiled kernels use) cost one call each. Older or other builds: the public API."""
    global _raw_stream
    if _raw_stream is None:
        c = _torch()._C
        get_raw = getattr(c, "_cuda_getCurrentRawStream", None)
        get_device = getattr(c, "_cuda_getDevice", None)
        if get_raw is not None and get_device is not None:
            _raw_stream = (get_device, get_raw)
        else:
            _raw_stream = ()
    if _raw_stream:
        get_device, get_raw = _raw_stream
        return int(get_raw(get_device()))
    return int(_torch().cuda.current_stream().cuda_stream)


class PoolSegment:
    """The pool's shared segment (see the module docstring). Its geometry is read once and
    checked against the segment's size; only the copies are used. Needs no GPU, so the layout
    checks are tested on segments of any geometry."""

    def __init__(self, seg: Any):
        self.seg = seg
        self.base = lib.omni_segment_data(seg)
        meta = ffi.cast("uint64_t *", self.base + _HANDLE)
        self.nbytes = int(meta[0])
        counts = ffi.cast("uint32_t *", self.base + _HANDLE + 8)
        self.device, self.slots = int(counts[0]), int(counts[1])
        size = int(lib.omni_segment_size(seg))
        if not (self.slots > 0 and PoolSegment.size(self.slots) <= size):
            raise BadTensorRecord(f"pool segment of {size} bytes cannot hold {self.slots} slots")
        if self.nbytes <= 0 or self.nbytes % _ALIGN:
            raise BadTensorRecord(f"pool of {self.nbytes} bytes: not a positive multiple of 512")
        self.states = ffi.cast("uint32_t *", self.base + _STATES)
        self.event_handles = self.base + _STATES + 4 * self.slots  # 64 bytes a slot

    @staticmethod
    def size(slots: int) -> int:
        return _STATES + 4 * slots + _HANDLE * slots

    def event_handle(self, slot: int) -> Any:
        return self.base + _STATES + 4 * self.slots + _HANDLE * slot

    def state(self, slot: int) -> int:
        return int(lib.omni_load_acquire_u32(self.states + slot))

    def set_state(self, slot: int, value: int) -> None:
        lib.omni_store_release_u32(self.states + slot, value)

    def check(self, rec: TensorRecord) -> None:
        """rec describes a block of this pool, and its dtype and shape fill exactly nbytes."""
        if rec.slot >= self.slots:
            raise BadTensorRecord(f"pool {rec.pool!r}: slot {rec.slot} of {self.slots}")
        if rec.offset % _ALIGN or rec.offset + rec.nbytes > self.nbytes:
            raise BadTensorRecord(
                f"pool {rec.pool!r}: block [{rec.offset}, +{rec.nbytes}) is not a block of its "
                f"{self.nbytes} bytes"
            )
        if rec.dtype not in _DTYPES or not hasattr(_torch(), rec.dtype):
            raise BadTensorRecord(f"dtype {rec.dtype!r} is not a tensor dtype")
        itemsize = getattr(_torch(), rec.dtype).itemsize
        if math.prod(rec.shape) * itemsize != rec.nbytes:
            raise BadTensorRecord(f"shape {rec.shape} of {rec.dtype} is not {rec.nbytes} bytes")

    def consumer_gone(self) -> bool:
        """A consumer that opened the pool died without leaving, and no live one is left to
        release anything (a consumer that closes gives its blocks back first)."""
        alive, dead = ffi.new("int *"), ffi.new("int *")
        lib.omni_segment_users(self.seg, alive, dead)
        return dead[0] > 0 and alive[0] == 0


class CudaPool:
    """Producer side: a device pool exported once, blocks handed out and taken back."""

    def __init__(self, name: str, nbytes: int, *, device: int = 0, slots: int = 1024):
        _require_cuda()
        torch = _torch()
        torch.cuda.set_device(device)
        torch.cuda.current_stream()  # makes torch's (primary) context current on this thread
        self.name = name
        self._device = device
        self.nbytes = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        out = ffi.new("omni_segment **")
        check(lib.omni_segment_create(name.encode(), PoolSegment.size(slots), out))
        self._events: dict[int, int] = {}
        # export_packed's per-slot arguments of omni_trec_export (event, handle, state word)
        self._slot_args: dict[int, tuple[int, Any, Any]] = {}
        self._dptr = 0
        try:
            p = ffi.new("uint64_t *")
            check(lib.omni_cuda_mem_alloc(self.nbytes, p))
            self._dptr = int(p[0])
            base = lib.omni_segment_data(out[0])
            check(lib.omni_cuda_ipc_get_mem_handle(self._dptr, base))
            ffi.cast("uint64_t *", base + _HANDLE)[0] = self.nbytes
            ffi.cast("uint32_t *", base + _HANDLE + 8)[0:2] = [device, slots]
            self._shared = PoolSegment(out[0])
        except BaseException:
            if self._dptr:
                lib.omni_cuda_mem_free(self._dptr)
            lib.omni_segment_close(out[0])
            raise
        self._bytes = _pool_bytes(self._dptr, self.nbytes)
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, size), sorted
        self._free_slots = list(range(slots - 1, -1, -1))
        self._in_flight: dict[int, tuple[int, int]] = {}  # slot -> (offset, size)
        self._blocks: dict[int, tuple[int, int]] = {}  # data_ptr -> (offset, size)
        # export_packed's record, its constant fields filled once
        self._trec = _trec.new()
        self._trec.device = device
        _trec.set_name(self._trec, "pool", name)
        ffi.memmove(self._trec.mem_handle, self._shared.base, _HANDLE)
        self._trec_cap = _trec.record_bytes(_trec.MAX_DIMS)
        self._trec_out = ffi.new("char[]", self._trec_cap)
        self._trec_len = ffi.new("uint64_t *")
        self._trec_key: str | None = None  # the key last set in the record (None: bare, "")
        _trec.set_name(self._trec, "key", "")
        self._dtype_codes = {getattr(torch, n): c for n, c in _trec.DTYPE_CODES.items()}

    # ---- blocks ----

    def empty(
        self,
        shape: tuple[int, ...],
        dtype: Any,
        timeout: float | None = None,
        peer_gone: Callable[[], bool] | None = None,
    ) -> Any:
        """A tensor in the pool, to fill and then send() without a copy. While the pool is
        full it waits up to timeout (None: as long as the consumer lives); `peer_gone` tells
        of a consumer that never opened the pool (say, the ring's peer_gone)."""
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * dtype.itemsize
        offset = self._allocate(max(nbytes, 1), timeout, peer_gone)
        tensor = _tensor_in(
            self._bytes, offset, nbytes, str(dtype).removeprefix("torch."), tuple(shape)
        )
        self._blocks[tensor.data_ptr()] = (offset, (max(nbytes, 1) + _ALIGN - 1) // _ALIGN * _ALIGN)
        return tensor

    def free(self, tensor: Any) -> None:
        """Gives back a block from empty() that was never exported."""
        block = self._blocks.pop(tensor.data_ptr(), None)
        if block is None:
            raise ValueError("free() takes a tensor from empty() of this pool, not yet exported")
        self._give_back(*block)

    def _allocate(
        self, nbytes: int, timeout: float | None, peer_gone: Callable[[], bool] | None
    ) -> int:
        size = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        if size > self.nbytes:
            raise PoolFull(f"pool {self.name!r}: {nbytes} bytes exceed its {self.nbytes} bytes")
        deadline = None  # read the clock only once the pool turned out full
        delay = 20e-6
        while True:
            self.reap()
            for i, (off, free) in enumerate(self._free):
                if free >= size:
                    self._free[i : i + 1] = [(off + size, free - size)] if free > size else []
                    return off
            if deadline is None and timeout is not None:
                deadline = time.monotonic() + timeout
            if deadline is not None and time.monotonic() >= deadline:
                raise PoolFull(f"pool {self.name!r}: no free {size} bytes before the timeout")
            # what is in flight comes back only from a live consumer
            if self._shared.consumer_gone() or (peer_gone is not None and peer_gone()):
                raise PoolClosed(
                    f"pool {self.name!r}: the consumer holding {len(self._in_flight)} blocks "
                    "died or left; they will not come back"
                )
            # Releases are not signalled to the producer: back off (bounded at 1 ms).
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def _give_back(self, off: int, size: int) -> None:
        self._free.append((off, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for o, s in self._free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        self._free = merged

    def reap(self) -> int:
        """Takes back the blocks the consumer released; returns how many. Every export calls
        it: O(blocks in flight), 1-2 in a crossing's steady state (a limit for pools that keep
        many blocks in flight)."""
        load, states = lib.omni_load_acquire_u32, self._shared.states
        done = [s for s in self._in_flight if load(states + s) == 0]
        for slot in done:
            self._give_back(*self._in_flight.pop(slot))
            self._free_slots.append(slot)
        return len(done)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    # ---- sending ----

    def export(
        self,
        tensor: Any,
        timeout: float | None = None,
        peer_gone: Callable[[], bool] | None = None,
    ) -> TensorRecord:
        """The record for a tensor made by empty() (no copy); any other CUDA tensor is first
        copied into a fresh block (one device-to-device copy). After this the block belongs to
        the consumer until it releases it: do not write the tensor again."""
        tensor, slot, offset = self._export(tensor, timeout, peer_gone)
        nbytes = tensor.numel() * tensor.element_size()
        dtype = str(tensor.dtype).removeprefix("torch.")
        return TensorRecord(self.name, slot, offset, nbytes, dtype, tuple(tensor.shape))

    def export_packed(self, tensor: Any, key: str | None = None, timeout: float = 0) -> bytes:
        """export() as a one-tensor record (tensor_records: C-encoded, about 200 bytes, read by
        CudaReceiver.open_packed): the message is the tensor, or {key: tensor} when `key` is
        given. Raises BadTensorRecord for a tensor the record cannot carry (its dtype, more than
        16 dims), before taking a block.

        The copy into the block, the slot's event, its state and the record's bytes are one C
        call (omni_trec_export); what stays in Python is reading the tensor's metadata and the
        block and slot bookkeeping."""
        rec = self._trec
        dtype = self._dtype_codes.get(tensor.dtype)
        ndim = tensor.dim()
        if dtype is None or ndim > _trec.MAX_DIMS:
            raise BadTensorRecord(f"a {tensor.dtype} tensor of {ndim} dims has no packed record")
        if key != self._trec_key:  # names repeat from message to message: encoded once
            _trec.set_name(rec, "key", key or "")
            self._trec_key = key
        tensor, block, src = self._block_for(tensor, timeout, None)
        slot = self._slot_for(tensor, block, src)
        rec.slot, rec.offset, rec.dtype, rec.ndim = slot, block[0], dtype, ndim
        rec.nbytes = tensor.nbytes
        rec.shape[0:ndim] = tensor.shape
        rec.strides[0:ndim] = tensor.stride()
        rec.flags = (_trec.KEYED if key is not None else 0) | (
            _trec.REQUIRES_GRAD if tensor.requires_grad else 0
        )
        args = self._slot_args.get(slot)
        if args is None:  # the slot's event, its handle's and its state's addresses: fixed
            args = (self._event(slot), self._shared.event_handle(slot), self._shared.states + slot)
            self._slot_args[slot] = args
        out, out_len = self._trec_out, self._trec_len
        rc = lib.omni_trec_export(
            rec, self._dptr, src or 0, _stream(), args[0], args[1], args[2], out, self._trec_cap,
            out_len,
        )  # fmt: skip
        if rc != lib.OMNI_OK:
            self._unslot(tensor, block, src, slot)
            if rc == lib.OMNI_EINVAL:
                raise BadTensorRecord(ffi.string(lib.omni_last_error()).decode(errors="replace"))
            raise error_for(rc)
        self._in_flight[slot] = block
        return ffi.unpack(out, out_len[0])

    def _export(
        self, tensor: Any, timeout: float | None, peer_gone: Callable[[], bool] | None
    ) -> tuple[Any, int, int]:
        """(the tensor as it lies in its block, its slot, its block's offset), the block in
        flight."""
        tensor, block, src = self._block_for(tensor, timeout, peer_gone)
        nbytes = tensor.nbytes
        if (
            src is not None and nbytes
        ):  # the raw copy: no view of the pool to make, no torch dispatch
            dst = self._dptr + block[0]
            check(lib.omni_cuda_memcpy_dtod_async(dst, src, nbytes, _stream()))
        slot = self._slot_for(tensor, block, src)
        # the consumer's stream waits on this event: our writes to the block come first
        check(lib.omni_cuda_event_record(self._event(slot), _stream()))
        self._in_flight[slot] = block
        self._shared.set_state(slot, 1)  # ordered before the ring push that carries the record
        return tensor, slot, block[0]

    def _block_for(
        self, tensor: Any, timeout: float | None, peer_gone: Callable[[], bool] | None
    ) -> tuple[Any, tuple[int, int], int | None]:
        """(the tensor, its block (offset, size), the device address to copy it from: None when
        it was made by empty() and already lies in its block)."""
        if not tensor.is_cuda:
            raise ValueError("export() takes a CUDA tensor; use push_arrays for host memory")
        made = self._blocks.pop(tensor.data_ptr(), None) if tensor.is_contiguous() else None
        if made is not None:
            return tensor, made, None
        if tensor.get_device() != self._device:
            raise ValueError(f"a tensor on {tensor.device} for a pool on cuda:{self._device}")
        tensor = tensor.contiguous()
        nbytes = tensor.nbytes
        offset = self._allocate(max(nbytes, 1), timeout, peer_gone)
        return tensor, (offset, (max(nbytes, 1) + _ALIGN - 1) // _ALIGN * _ALIGN), tensor.data_ptr()

    def _slot_for(self, tensor: Any, block: tuple[int, int], src: int | None) -> int:
        """A free slot for the block (PoolFull, the block given back, when all are in flight)."""
        if not self._free_slots:
            self.reap()
        if not self._free_slots:
            self._unblock(tensor, block, src)
            raise PoolFull(f"pool {self.name!r}: all {self._shared.slots} slots in flight")
        return self._free_slots.pop()

    def _unblock(self, tensor: Any, block: tuple[int, int], src: int | None) -> None:
        if src is not None:  # a block of our own for a copy: free again
            self._give_back(*block)
        else:  # the caller's block from empty(): still theirs
            self._blocks[tensor.data_ptr()] = block

    def _unslot(self, tensor: Any, block: tuple[int, int], src: int | None, slot: int) -> None:
        self._free_slots.append(slot)
        self._unblock(tensor, block, src)

    def _event(self, slot: int) -> int:
        """The slot's interprocess event, made (and its handle published) on first use."""
        event = self._events.get(slot)
        if event is None:
            e = ffi.new("uint64_t *")
            check(lib.omni_cuda_event_create_ipc(e))
            event = self._events[slot] = int(e[0])
            check(lib.omni_cuda_ipc_get_event_handle(event, self._shared.event_handle(slot)))
        return event

    def close(self) -> None:
        """Frees the pool. Consumers must have closed their receivers (their mapping of the
        pool is undefined after the owner frees it)."""
        if self._dptr:
            for event in self._events.values():
                lib.omni_cuda_event_destroy(event)
            self._events.clear()
            self._slot_args.clear()
            self._bytes = None
            lib.omni_cuda_mem_free(self._dptr)
            self._dptr = 0
            lib.omni_segment_close(self._shared.seg)

    def __enter__(self) -> CudaPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _OpenPool:
    def __init__(self, name: str):
        out = ffi.new("omni_segment **")
        check(lib.omni_segment_attach(name.encode(), out))
        try:
            self.shared = PoolSegment(out[0])
        except BaseException:
            lib.omni_segment_close(out[0])
            raise
        p = ffi.new("uint64_t *")
        rc = lib.omni_cuda_ipc_open_mem_handle(self.shared.base, p)
        if rc != lib.OMNI_OK:
            lib.omni_segment_close(out[0])
            raise error_for(rc)
        self.dptr = int(p[0])
        self.bytes = _pool_bytes(self.dptr, self.shared.nbytes)
        self.events: dict[int, int] = {}
        self.live = ffi.new("uint64_t *")  # open_packed views not yet freed (their deleters)
        # (offset, nbytes, dtype, shape) -> the view of the pool there: blocks and shapes
        # repeat from message to message, and making a view is three torch calls
        self._views: dict[tuple[int, int, str, tuple[int, ...]], Any] = {}

    def view(self, rec: TensorRecord) -> Any:
        key = (rec.offset, rec.nbytes, rec.dtype, rec.shape)
        tensor = self._views.get(key)
        if tensor is None:
            if len(self._views) >= _VIEW_CACHE:
                self._views.clear()
            tensor = self._views[key] = _tensor_in(self.bytes, *key)
        return tensor

    def event(self, slot: int) -> int:
        e = self.events.get(slot)
        if e is None:
            p = ffi.new("uint64_t *")
            check(lib.omni_cuda_ipc_open_event_handle(self.shared.event_handle(slot), p))
            e = self.events[slot] = int(p[0])
        return e

    def close(self) -> None:
        for e in self.events.values():
            lib.omni_cuda_event_destroy(e)
        self._views.clear()
        self.bytes = None
        lib.omni_cuda_ipc_close_mem_handle(self.dptr)
        lib.omni_segment_close(self.shared.seg)


_kept: list[_OpenPool] = []  # pools closed by their receiver while views were alive


class CudaReceiver:
    """Consumer side: opens each pool once, turns records into tensors, releases blocks."""

    def __init__(self, *, device: int = 0):
        _require_cuda()
        torch = _torch()
        torch.cuda.set_device(device)
        torch.cuda.current_stream()
        self._pools: dict[str, _OpenPool] = {}
        self._held: set[tuple[str, int]] = set()  # (pool, slot) opened and not released
        self._done = ffi.new("uint64_t *")
        check(lib.omni_cuda_event_create_ipc(self._done))
        # release(wait=False): blocks whose event has not completed yet, oldest first, and
        # the recorded events that are free for reuse
        self._releasing: list[tuple[int, str, int]] = []  # (event, pool, slot)
        self._spare_events: list[int] = []
        self._trec = _trec.new()  # open_packed's parsed record, reused
        self._view_out = ffi.new("void **")
        self._packed = False  # open_packed was used: close() waits for its releases

    def open(self, rec: TensorRecord) -> Any:
        """A tensor viewing the producer's block; work queued on the current stream after
        this call sees the producer's writes. Valid until release(rec). A later record of the
        same block, dtype and shape may give the same tensor object: never change its metadata
        (resize_, set_, as_strided_)."""
        if self._releasing:
            self.reap()
        pool = self._pools.get(rec.pool)
        if pool is None:
            pool = self._pools[rec.pool] = _OpenPool(rec.pool)
        pool.shared.check(rec)
        if pool.shared.state(rec.slot) != 1 or (rec.pool, rec.slot) in self._held:
            raise BadTensorRecord(f"pool {rec.pool!r} slot {rec.slot} is not in flight")
        check(lib.omni_cuda_stream_wait_event(_stream(), pool.event(rec.slot)))
        tensor = pool.view(rec)
        self._held.add((rec.pool, rec.slot))
        return tensor

    def open_packed(self, data: bytes | memoryview) -> tuple[str | None, Any]:
        """(key, tensor) of a record from CudaPool.export_packed (key None: the message was the
        bare tensor). The tensor is a view of the producer's block, not a copy: work queued on
        the current stream after this call sees the producer's writes, and the block goes back
        once the tensor's storage is freed (every view of it) and the work queued on this
        stream by then is done. Work on another stream must be waited for before the tensor
        is dropped (torch's record_stream rule). BadTensorRecord for bytes or a block that do
        not check out: nothing is opened."""
        rec = self._trec
        try:
            name, key = _trec.decode(data, rec)
        except _trec.BadRecord as exc:
            raise BadTensorRecord(str(exc)) from None
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = _OpenPool(name)
        shared, slot, out = pool.shared, rec.slot, self._view_out
        # a slot past the pool's is refused by accept's slot check, before any handle is read
        event = pool.event(slot) if slot < shared.slots else 0
        rc = lib.omni_trec_accept(
            rec, shared.nbytes, shared.slots, shared.device, shared.base, shared.event_handles,
            shared.states, event, pool.dptr, _stream(), pool.live, out,
        )  # fmt: skip
        if rc != lib.OMNI_OK:
            if rc == lib.OMNI_EINVAL:
                raise BadTensorRecord(ffi.string(lib.omni_last_error()).decode(errors="replace"))
            raise error_for(rc)
        tensor = _trec.take(out[0])
        self._packed = True
        if rec.flags & _trec.REQUIRES_GRAD:
            tensor.requires_grad_(True)
        return (key if rec.flags & _trec.KEYED else None), tensor

    def mapped_at(self, pool: str) -> int:
        """The device address pool `pool` is mapped at in this process (opened at its first
        record): a tensor from open(rec) starts at mapped_at(rec.pool) + rec.offset."""
        return self._pools[pool].dptr

    def release(self, rec: TensorRecord, *, wait: bool = True) -> None:
        """Hands the block back once the GPU work queued so far on the current stream is
        done. `wait=True` waits for that work here; `wait=False` returns at once and the block
        goes back at a later `reap()` (or `open()`, which reaps first) that finds the work done:
        the caller keeps the host free while, e.g., a copy out of the block runs."""
        if (rec.pool, rec.slot) not in self._held:
            raise BadTensorRecord(f"pool {rec.pool!r} slot {rec.slot} is not held here")
        self._held.discard((rec.pool, rec.slot))
        if wait:
            check(lib.omni_cuda_event_record(self._done[0], _stream()))
            check(lib.omni_cuda_event_synchronize(self._done[0]))
            self._pools[rec.pool].shared.set_state(rec.slot, 0)
            return
        if self._spare_events:
            event = self._spare_events.pop()
        else:
            out = ffi.new("uint64_t *")
            check(lib.omni_cuda_event_create_ipc(out))
            event = out[0]
        check(lib.omni_cuda_event_record(event, _stream()))
        self._releasing.append((event, rec.pool, rec.slot))

    def reap(self) -> int:
        """Hands back the blocks of `release(wait=False)` whose GPU work is done; returns how
        many are still waiting. Events complete in stream order, so the first one not done
        ends the scan."""
        while self._releasing:
            event, pool, slot = self._releasing[0]
            rc = lib.omni_cuda_event_query(event)
            if rc == lib.OMNI_EEMPTY:
                break
            check(rc)
            self._releasing.pop(0)
            self._spare_events.append(event)
            self._pools[pool].shared.set_state(slot, 0)
        return len(self._releasing)

    @property
    def releasing(self) -> int:
        """Blocks released without waiting whose GPU work has not been seen done yet."""
        return len(self._releasing)

    def close(self) -> None:
        """Gives back every block still held (after the GPU work queued on the current stream)
        and closes the pools: the producer is never left waiting for blocks of a receiver that
        is gone."""
        if (self._held or self._releasing) and self._done[0]:
            check(lib.omni_cuda_event_record(self._done[0], _stream()))
            check(lib.omni_cuda_event_synchronize(self._done[0]))
            for name, slot in self._held:
                self._pools[name].shared.set_state(slot, 0)
            for _, name, slot in self._releasing:
                self._pools[name].shared.set_state(slot, 0)
            self._spare_events.extend(event for event, _, _ in self._releasing)
            self._held.clear()
            self._releasing.clear()
        for event in self._spare_events:
            lib.omni_cuda_event_destroy(event)
        self._spare_events.clear()
        if self._packed:  # the host functions that store freed slots' states have run
            check(lib.omni_cuda_synchronize())
        for pool in self._pools.values():
            if pool.live[0]:
                # views still alive: their memory and their deleters' state words must stay
                # mapped (until the process exits); the producer gets those blocks back when
                # they are freed
                _kept.append(pool)
            else:
                pool.close()
        self._pools.clear()
        if self._done[0]:
            lib.omni_cuda_event_destroy(self._done[0])
            self._done[0] = 0

    def __enter__(self) -> CudaReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- over a ring ----


def send_tensor(ring: Ring, pool: CudaPool, tensor: Any, timeout: float | None = None) -> None:
    """Pushes one tensor's record; the tensor's block is the consumer's until released."""
    ring.push(pool.export(tensor, timeout, ring.peer_gone).to_bytes(), timeout=timeout)


def recv_tensor(
    ring: Ring, receiver: CudaReceiver, timeout: float | None = None
) -> tuple[Any, TensorRecord]:
    """Pops a record from send_tensor: (tensor, record); call receiver.release(record) when
    done with the tensor."""
    rec: Record = ring.pop(timeout)
    with rec:
        trec = TensorRecord.from_bytes(rec.header)
    return receiver.open(trec), trec
