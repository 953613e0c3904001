"""Messages as bytes for other processes: a pickled header plus out-of-band buffers.

Pickle protocol 5 keeps large contiguous buffers (numpy arrays) out of the header, so a sender
hands them to the transport as they are (the SHM ring copies each once into shared memory) and
the receiver rebuilds arrays over the received memory. Torch CPU tensors travel as numpy arrays
(bfloat16 and other dtypes numpy lacks travel as same-sized integers and are viewed back), so a
worker imports torch only when a tensor actually reaches it.

A message that is one CUDA tensor towards a receiver on its GPU skips pickle: a C-encoded
one-tensor record (`cuda_lane.open_packed`).

CUDA tensors: to a receiver on the same GPU they cross as CUDA IPC records (`cuda.py`, the
`cuda` lane given to encode()); otherwise they are copied to the host, and return to their GPU on
the other side only if a stage there uses that GPU (never in the server process).
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any, Protocol

# numpy has no bfloat16 / float8: such tensors travel as integers of the same width
_WIDTH_VIEWS = {2: "int16", 1: "int8"}


class CudaLane(Protocol):
    def export(self, tensor: Any) -> bytes | None:
        """A CUDA IPC record for `tensor`, or None to send it through the host."""

    def export_packed(self, tensor: Any, key: str | None) -> bytes | None:
        """The one-tensor record of the message `tensor` (or {key: tensor}), or None (pickle)."""


class _Pickler(pickle.Pickler):
    def __init__(self, *args: Any, cuda: CudaLane | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cuda = cuda

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            if obj.is_cuda and self._cuda is not None:
                record = self._cuda.export(obj.detach())
                if record is not None:
                    return _open_cuda, (record, obj.device.index, bool(obj.requires_grad))
            return _reduce_tensor(torch, obj)
        return NotImplemented


def _open_cuda(record: bytes, device: int, requires_grad: bool) -> Any:
    from .cuda_lane import open_tensor

    tensor = open_tensor(record, device)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def _reduce_tensor(torch: Any, tensor: Any) -> Any:
    device = str(tensor.device)
    host = tensor.detach().to("cpu").contiguous()
    dtype = str(host.dtype).removeprefix("torch.")
    try:
        array = host.numpy()
    except TypeError:  # a dtype numpy lacks: ship the raw bits
        view = getattr(torch, _WIDTH_VIEWS[host.element_size()])
        array = host.view(view).numpy()
    return _rebuild_tensor, (array, dtype, device, bool(tensor.requires_grad))


# GPUs the stages of this process use: a CUDA tensor that came through the host returns to its
# device only here; elsewhere (the server process, a stage on another GPU) it stays on the CPU.
_local_devices: frozenset[int] = frozenset()


def set_local_devices(devices: frozenset[int]) -> None:
    global _local_devices
    _local_devices = devices


def _rebuild_tensor(array: Any, dtype: str, device: str, requires_grad: bool) -> Any:
    import torch  # only a process that receives a tensor needs torch

    if not array.flags.writeable:
        array = array.copy()
    tensor = torch.from_numpy(array)
    wanted = getattr(torch, dtype)
    if tensor.dtype != wanted:
        tensor = tensor.view(wanted)
    if device.startswith("cuda:") and int(device[5:]) in _local_devices:
        tensor = tensor.to(device)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


class Unencodable(TypeError):
    """A message holds a value that cannot cross processes (a lambda, an open file, a lock).
    Nothing was sent; the request it belongs to fails, not the process."""


def encode(message: Any, cuda: CudaLane | None = None) -> tuple[bytes, list[memoryview]]:
    """The message as (header, buffers); the buffers alias the message's arrays (no copy).

    `cuda`: the CUDA IPC lane towards the receiver, when it shares a GPU with this process.
    Raises Unencodable for a value pickle refuses."""
    if cuda is not None:
        packed = _one_cuda_tensor(message, cuda)
        if packed is not None:
            return packed, []
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    try:
        _Pickler(out, protocol=5, buffer_callback=buffers.append, cuda=cuda).dump(message)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise Unencodable(f"{type(exc).__name__}: {exc}") from exc
    return out.getvalue(), [b.raw() for b in buffers]


def _one_cuda_tensor(message: Any, cuda: CudaLane) -> bytes | None:
    """The fast path's record when the message is one CUDA tensor (bare, or {str: tensor})."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    key = None
    if type(message) is dict and len(message) == 1:
        ((key, message),) = message.items()
        if type(key) is not str:
            return None
    if type(message) is not torch.Tensor or not message.is_cuda:
        return None
    return cuda.export_packed(message, key)


def decode(header: bytes | memoryview, buffers: list[Any]) -> Any:
    """Rebuild a message; arrays in it alias `buffers`, which must outlive them."""
    if header[:4] == _PACKED and not buffers:
        from .cuda_lane import open_packed

        return open_packed(header)
    return pickle.loads(header, buffers=buffers)


_PACKED = b"OTR1"  # a one-tensor record (pickle protocol 5 starts with b"\x80\x05")
