"""Prepared weights: a model's placed weights written once as a file, so that the processes
after the first (a stage process restarted after a crash or a freeze, another replica) map
them instead of preparing them again. Dequantizing the embedded SmolLM2 GGUF and reading its
header is most of a thinker restart on a loaded machine (docs/runtime.md, "Recovery").

The file is safetensors (8-byte little-endian header length, the JSON header, the tensors'
bytes packed in header order), so any safetensors reader opens it; the engine's own metadata
sits in `__metadata__["omni.prepared"]` as JSON:

    {"stamp":  what the weights were prepared from and for: the format, the engine's version,
               the source file (path, size, mtime_ns), dtype, device type, weight order, TP rank,
     "source": what the source needs to be opened again without reading its file (a GGUF:
               its header's key/values, whether the head is tied),
     "transposed": the parameters stored by columns (huge_pages.columns_first): their bytes are
               the transpose, row-major, as they lie in memory,
     "sha256": the digest of every other byte of the file: the header without this field,
               then the tensors}

A file whose stamp is not the one expected (the source changed, another dtype) is stale; one
whose digest, layout or ownership is wrong is refused. Either way the caller prepares the
weights again and writes them over it. Readers see a whole file or none: it is written to a
temporary name (mode 0600, O_EXCL) and renamed. It lives in the server run's private
directory (StageContext.prepared_dir) and goes with it.

Invariant: a prepared file is only ever mapped read-only (PROT_READ): nothing can write through
a reader's mapping; the placed module gets copies (its own huge-page buffer on the CPU).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import stat
import struct
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import omni_server

FORMAT = 1
METADATA_KEY = "omni.prepared"
_MAX_HEADER_BYTES = 64 << 20  # a GGUF's vocabulary and merges: ~2 MB of JSON
_ALIGN = 64  # the tensors' bytes start on a cache line (the header is padded with spaces)
_CHUNK = 16 << 20  # digest and write in pieces: no whole-model temporary

# safetensors' dtype names
_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
}
_TORCH = {name: dtype for dtype, name in _DTYPES.items()}


class PreparedError(ValueError):
    """A prepared file that must not be used (stale, corrupt, not ours); the message says why."""


def stamp(source: Path, **settings: Any) -> dict[str, Any]:
    """What weights prepared from the file `source` with `settings` (JSON values: dtype,
    device type, weight order, TP rank ...) are: a file with another stamp is stale."""
    st = source.stat()
    return {
        "format": FORMAT,
        "engine": omni_server.__version__,
        "source": {"path": str(source.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns},
        **settings,
    }


def file_name(source: Path, **settings: Any) -> str:
    """The prepared file's name for `source` and `settings`: readable, filesystem-safe (a stale
    file of the same source and settings is replaced, not kept beside the new one)."""
    parts = [source.stem, *(f"{k}-{v}" for k, v in sorted(settings.items()))]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", ".".join(parts))[:200] + ".safetensors"


@dataclass
class PreparedFile:
    """A prepared file mapped read-only and checked; `tensors` view the mapping."""

    path: Path
    header: dict[str, Any]  # the omni.prepared metadata
    tensors: dict[str, torch.Tensor]  # name -> read-only view, in memory order
    nbytes: int
    _map: mmap.mmap

    def parameter(self, name: str) -> torch.Tensor:
        """Parameter `name` in its logical shape (a transposed one: the stored bytes' view)."""
        value = self.tensors[name]
        return value.t() if name in self._transposed else value

    @property
    def _transposed(self) -> frozenset[str]:
        return frozenset(self.header.get("transposed", ()))

    def close(self) -> None:
        """Drop the mapping (after the copies: nothing may view it afterwards)."""
        self.tensors.clear()
        self._map.close()


def write(path: Path, parameters: Mapping[str, torch.Tensor], metadata: dict[str, Any]) -> int:
    """Write `parameters` and `metadata` (the stamp, the source's header) as the prepared file
    `path`, atomically (temporary name, mode 0600, then rename). Returns the bytes written.
    A parameter stored by columns is written as its transpose (its bytes in memory order)."""
    stored: dict[str, torch.Tensor] = {}
    transposed = []
    for name, value in parameters.items():
        value = value.detach()
        if value.dtype not in _DTYPES:
            raise PreparedError(f"parameter {name}: dtype {value.dtype} cannot be stored")
        if not value.is_contiguous() and value.dim() == 2 and value.t().is_contiguous():
            value = value.t()  # stored by columns: its bytes as they lie in memory
            transposed.append(name)
        stored[name] = value.contiguous().cpu()
    entries: dict[str, Any] = {}
    offset = 0
    for name, value in stored.items():
        size = value.numel() * value.element_size()
        entries[name] = {
            "dtype": _DTYPES[value.dtype],
            "shape": list(value.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    prepared = {**metadata, "transposed": transposed}
    digest = hashlib.sha256(_signed_header(entries, prepared))
    for value in stored.values():
        for piece in _pieces(value):
            digest.update(piece)
    header = _header_bytes(entries, {**prepared, "sha256": digest.hexdigest()})
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for value in stored.values():
                for piece in _pieces(value):
                    f.write(piece)
        os.replace(tmp, path)  # readers see the whole file or the one before
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return 8 + len(header) + offset


def read(path: Path, expected_stamp: Mapping[str, Any]) -> PreparedFile | None:
    """The prepared file `path` mapped read-only, after checking that it is this user's file
    (mode 0600, not a link), a well-formed safetensors file whose stamp is `expected_stamp`
    and whose digest matches. None when there is no file; PreparedError when there is one
    that must not be used."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as err:  # ELOOP: a link where the file should be
        raise PreparedError(f"cannot open it ({err})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PreparedError("not a file of this user with mode 0600")
        if st.st_size < 8:
            raise PreparedError(f"{st.st_size} bytes: truncated")
        # MAP_POPULATE: the pages are mapped in one call, not faulted one by one by the digest
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapped = mmap.mmap(fd, st.st_size, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        return _checked(path, mapped, expected_stamp)
    except BaseException:
        mapped.close()
        raise


def _checked(path: Path, mapped: mmap.mmap, expected_stamp: Mapping[str, Any]) -> PreparedFile:
    (length,) = struct.unpack_from("<Q", mapped, 0)
    if not 0 < length <= min(_MAX_HEADER_BYTES, len(mapped) - 8):
        raise PreparedError(f"header length {length} does not fit the file")
    try:
        header = json.loads(mapped[8 : 8 + length])
        prepared = json.loads(header.pop("__metadata__")[METADATA_KEY])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise PreparedError(f"not a prepared-weights safetensors header ({err})") from None
    if not isinstance(prepared, dict) or prepared.get("stamp") != dict(expected_stamp):
        found = prepared.get("stamp") if isinstance(prepared, dict) else None
        raise PreparedError(f"stale: prepared as {found}, expected {dict(expected_stamp)}")
    start = 8 + length
    entries = _layout(header, len(mapped) - start)
    claimed = prepared.pop("sha256", None)
    digest = hashlib.sha256(_signed_header(header, prepared))
    view = memoryview(mapped)
    for begin in range(start, len(mapped), _CHUNK):
        digest.update(view[begin : min(begin + _CHUNK, len(mapped))])
    view.release()
    if claimed != digest.hexdigest():
        raise PreparedError("its digest does not match its contents: corrupt or altered")
    with warnings.catch_warnings():  # a read-only buffer: torch warns that it is not writable
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(mapped, dtype=torch.uint8)
    tensors = {
        name: raw[start + begin : start + end].view(dtype).view(shape)
        for name, (dtype, shape, begin, end) in entries.items()
    }
    return PreparedFile(path, prepared, tensors, len(mapped), mapped)


Layout = dict[str, tuple[torch.dtype, list[int], int, int]]  # name -> dtype, shape, begin, end


def _layout(header: dict[str, Any], data_bytes: int) -> Layout:
    """The tensors' (dtype, shape, begin, end), checked: packed in order from 0, each as long
    as its shape and dtype say, together exactly the data that follows the header."""
    entries = {}
    offset = 0
    for name, entry in header.items():
        try:
            dtype = _TORCH[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise PreparedError(f"tensor {name!r}: malformed entry ({err})") from None
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if begin != offset or end - begin != size or any(d < 0 for d in shape):
            raise PreparedError(f"tensor {name!r}: offsets {begin}..{end} disagree with its shape")
        entries[name] = (dtype, shape, begin, end)
        offset = end
    if offset != data_bytes:
        raise PreparedError(f"{data_bytes} bytes of tensors, the header accounts for {offset}")
    return entries


def _signed_header(entries: Mapping[str, Any], prepared: Mapping[str, Any]) -> bytes:
    """What the digest covers besides the tensors' bytes: the layout and the metadata (the
    digest itself left out), canonical JSON."""
    return json.dumps([entries, prepared], sort_keys=True, separators=(",", ":")).encode()


def _header_bytes(entries: Mapping[str, Any], prepared: Mapping[str, Any]) -> bytes:
    header = {"__metadata__": {METADATA_KEY: json.dumps(prepared)}, **entries}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-(8 + len(raw)) % _ALIGN)


def _pieces(value: torch.Tensor) -> Iterator[memoryview]:
    """A contiguous CPU tensor's bytes, in pieces."""
    flat = value.reshape(-1).view(torch.uint8).numpy()
    for begin in range(0, flat.size, _CHUNK):
        yield memoryview(flat[begin : begin + _CHUNK].data)
