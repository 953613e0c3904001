"""CUDA tensors between stage processes on one GPU, through `omni_transport.cuda_ipc`.

The only branch of the data plane that knows about GPUs. It engages when a message carries a
CUDA tensor to a process that hosts a stage on the same GPU; everything else (CPU tensors, a
receiver on another GPU or on none, a full pool) takes the host-copy path of `codec`.

Sender: one exported device pool per (process, GPU), made on first use; a tensor crosses as a
small record (pool, slot, offset, dtype, shape) inside the message header. Receiver: opens
the pool once, queues a copy of the tensor out of the block on the device (one device-to-device
copy, so the backend owns a normal tensor and the sender's block comes back soon), and releases
the block without waiting for that copy: the block goes back to the sender once the copy is seen
done, checked at the next arrival and by a short timer on the loop (so the loop never waits for
the GPU, and a quiet receiver still returns its blocks). Both sides run on the process's
event-loop thread, as the pool and receiver require.

A message that is one CUDA tensor (the bare tensor, or a dict of one str key to it) takes the
fast path instead: a C-encoded one-tensor record (`omni_transport.tensor_records`: no pickle,
about 200 bytes, every field checked on arrival), and the receiver hands on the pool's block
itself as a tensor (a DLPack view, no clone): the block goes back to the sender once that
tensor is freed and the work queued on the receiving stream by then is done.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable
from typing import Any

from omni_transport import TransportError

log = logging.getLogger(__name__)

_POOL_BYTES = int(os.environ.get("OMNI_CUDA_POOL_BYTES", str(256 << 20)))

# what crossed how, in this process (tests and diagnostics read it)
stats = {"ipc_sent": 0, "ipc_received": 0, "packed_sent": 0, "packed_received": 0}


class CudaExporter:
    """The sender side of one process: its pools, and which receivers share which GPUs."""

    def __init__(self, name_prefix: str, peer_devices: dict[str, frozenset[int]]) -> None:
        self._prefix = name_prefix
        self._peer_devices = peer_devices
        self._pools: dict[int, Any] = {}
        self._disabled = False
        # OMNI_CUDA_PACKED=0: every CUDA tensor takes the pickle path (benchmarks compare)
        self._packed = os.environ.get("OMNI_CUDA_PACKED", "1") != "0"

    def for_receiver(self, receiver: str) -> _Lane | None:
        devices = self._peer_devices.get(receiver)
        return _Lane(self, devices) if devices and not self._disabled else None

    def _pool(self, device: int) -> Any:
        """This process's pool on `device`, made on first use (raises TransportError where CUDA
        IPC is unusable)."""
        import omni_transport.cuda_ipc as cuda_ipc

        pool = self._pools.get(device)
        if pool is None:
            name = f"{self._prefix}-cuda{device}"
            pool = self._pools[device] = cuda_ipc.CudaPool(name, _POOL_BYTES, device=device)
        return pool

    def export(self, tensor: Any) -> bytes | None:
        """The record bytes of `tensor` moved into this process's pool, or None (host path)."""
        import omni_transport.cuda_ipc as cuda_ipc
        from omni_transport import TransportError

        try:
            record = self._pool(tensor.device.index).export(tensor, timeout=0)
        except cuda_ipc.PoolFull:
            return None  # the receivers hold the pool: this tensor goes through the host
        except TransportError as exc:  # no usable CUDA IPC here (driver, platform)
            log.warning("CUDA IPC unavailable, tensors go through the host: %s", exc)
            self._disabled = True
            return None
        stats["ipc_sent"] += 1
        return record.to_bytes()

    def export_packed(self, tensor: Any, key: str | None, device: int) -> bytes | None:
        """The one-tensor record of `tensor` (or of {key: tensor}) on `device` moved into this
        process's pool, or None: the message takes the pickle path (a dtype or rank the record
        lacks, a full pool, no CUDA IPC here)."""
        if not self._packed:
            return None
        pool = self._pools.get(device)
        try:  # (no detach: the lane sends no tensor that requires grad this way)
            if pool is None:
                pool = self._pool(device)
            record = pool.export_packed(tensor, key)
        except TransportError as exc:
            import omni_transport.cuda_ipc as cuda_ipc

            if isinstance(exc, (cuda_ipc.PoolFull, cuda_ipc.BadTensorRecord)):
                return None
            log.warning("CUDA IPC unavailable, tensors go through the host: %s", exc)
            self._disabled = True
            return None
        stats["ipc_sent"] += 1
        stats["packed_sent"] += 1
        return record

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


class _Lane:
    """CUDA IPC towards one receiver: only for tensors on a GPU the receiver uses."""

    def __init__(self, exporter: CudaExporter, devices: Iterable[int]) -> None:
        self._exporter = exporter
        self._devices = frozenset(devices)

    def export(self, tensor: Any) -> bytes | None:
        if tensor.device.index not in self._devices:
            return None
        return self._exporter.export(tensor)

    def export_packed(self, tensor: Any, key: str | None) -> bytes | None:
        device = tensor.get_device()
        if device not in self._devices or tensor.requires_grad:
            return None  # (a tensor that requires grad keeps the pickle path's detached clone)
        return self._exporter.export_packed(tensor, key, device)


_receivers: dict[int, Any] = {}


def open_tensor(record: bytes, device: int) -> Any:
    """The receiver side: a tensor of our own with the record's contents (codec calls it)."""
    import omni_transport.cuda_ipc as cuda_ipc

    receiver = _receivers.get(device)
    if receiver is None:
        receiver = _receivers[device] = cuda_ipc.CudaReceiver(device=device)
    rec = cuda_ipc.TensorRecord.from_bytes(record)
    view = receiver.open(rec)
    tensor = view.clone()  # queued after the wait on the sender's event
    receiver.release(rec, wait=False)  # the block goes back once the clone is done
    stats["ipc_received"] += 1
    _schedule_reap(0)
    return tensor


def open_packed(record: bytes | memoryview) -> Any:
    """The receiver side of a one-tensor record: the bare tensor, or {key: tensor}. The tensor
    is the sender's block itself (no clone); it goes back to the sender when freed."""
    import omni_transport.cuda_ipc as cuda_ipc

    device = int.from_bytes(bytes(record[8:12]), "little")  # checked against the pool's
    receiver = _receivers.get(device)
    if receiver is None:
        if device not in _devices():
            raise cuda_ipc.BadTensorRecord(f"tensor record for cuda:{device}: no such GPU here")
        receiver = _receivers[device] = cuda_ipc.CudaReceiver(device=device)
    key, tensor = receiver.open_packed(record)
    stats["ipc_received"] += 1
    stats["packed_received"] += 1
    return tensor if key is None else {key: tensor}


def _devices() -> range:
    import torch

    return range(torch.cuda.device_count())


# the timer that hands blocks back when no further arrival does: 0.25 ms, doubling to 8 ms
_REAP_DELAYS_S = (0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008)
_reap_timer: asyncio.TimerHandle | None = None


def _schedule_reap(attempt: int) -> None:
    global _reap_timer
    if _reap_timer is not None:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # decoded outside a loop (tests): the next open() reaps
        return
    delay = _REAP_DELAYS_S[min(attempt, len(_REAP_DELAYS_S) - 1)]
    _reap_timer = loop.call_later(delay, _reap, attempt)


def _reap(attempt: int) -> None:
    global _reap_timer
    _reap_timer = None
    if sum(receiver.reap() for receiver in _receivers.values()):
        _schedule_reap(attempt + 1)


def close_receivers() -> None:
    global _reap_timer
    if _reap_timer is not None:
        _reap_timer.cancel()
        _reap_timer = None
    for receiver in _receivers.values():
        receiver.close()
    _receivers.clear()
