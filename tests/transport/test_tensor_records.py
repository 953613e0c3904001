"""The one-tensor record (C-encoded, tensor_record.c) and its DLPack view: the layout round
trips, hostile bytes are refused by the C checks, a record must name a block of its pool, and
the view gives its block back only when the last tensor sharing its storage is freed. All on
the CPU: the record needs no GPU, and the view's lifetime is the same over host memory (the
CUDA crossing itself is in test_cuda_ipc.py, marked gpu)."""

from __future__ import annotations

import random
import struct

import pytest
import torch

from omni_transport import tensor_records as tr
from omni_transport.cabi import ffi, lib

MEM = bytes(range(64))
EVENT = bytes(range(64, 128))


def _record(
    shape=(4, 8), dtype="bfloat16", key: str | None = "t", offset=1024, strides=None
) -> object:
    rec = tr.new()
    rec.device, rec.slot, rec.offset = 0, 3, offset
    rec.dtype, rec.ndim = tr.DTYPE_CODES[dtype], len(shape)
    rec.shape[0 : len(shape)] = list(shape)
    if strides is None:
        strides = torch.empty(shape).stride()
    rec.strides[0 : len(shape)] = list(strides)
    numel = 1
    for d in shape:
        numel *= d
    rec.nbytes = numel * lib.omni_trec_itemsize(rec.dtype)
    rec.flags = tr.KEYED if key is not None else 0
    tr.set_name(rec, "pool", "omni-run-a-cuda0")
    tr.set_name(rec, "key", key or "")
    ffi.memmove(rec.mem_handle, MEM, 64)
    ffi.memmove(rec.event_handle, EVENT, 64)
    return rec


def _encode(rec: object) -> bytes:
    out = ffi.new("char[]", tr.record_bytes(tr.MAX_DIMS))
    return tr.encode(rec, out, ffi.new("uint64_t *"))


def _decode(data: bytes) -> dict:
    rec = tr.new()
    tr.decode(data, rec)
    return tr.fields(rec)


@pytest.mark.parametrize(
    ("shape", "dtype", "key"),
    [
        ((4, 8), "bfloat16", "t"),
        ((1 << 20,), "float32", None),
        ((), "int64", "scalar"),
        ((2, 0, 3), "float16", "empty"),
        (tuple([1] * 16), "bool", "deep"),
        ((3, 5), "complex128", "naïve key"),
    ],
)
def test_a_record_round_trips(shape, dtype, key):
    data = _encode(_record(shape, dtype, key))
    assert tr.is_record(data) and not tr.is_record(b"\x80\x05rest")
    got = _decode(data)
    assert got["shape"] == shape and got["dtype"] == dtype
    assert got["key"] == (key or "") and got["flags"] == (tr.KEYED if key is not None else 0)
    assert got["pool"] == "omni-run-a-cuda0" and got["slot"] == 3 and got["offset"] == 1024
    assert got["mem_handle"] == MEM and got["event_handle"] == EVENT
    assert got["strides"] == torch.empty(shape).stride()


def _patched(data: bytes, at: int, fmt: str, value: int) -> bytes:
    raw = bytearray(data)
    struct.pack_into(fmt, raw, at, value)
    return bytes(raw)


GOOD = _encode(_record((4, 8), "float32", "t"))
SHAPE0 = 168  # the first dimension's size (after the fixed part)
STRIDE0 = 168 + 16  # the first dimension's stride (2 dims)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (GOOD[:-1], "bytes, not what"),
        (GOOD + b"x", "bytes, not what"),
        (GOOD[:100], "not a tensor record"),
        (b"OTR2" + GOOD[4:], "not a tensor record"),
        (_patched(GOOD, 4, "<H", 2), "version 2"),
        (_patched(GOOD, 6, "<B", 17), "17 dimensions"),
        (_patched(GOOD, 7, "<B", 15), "dtype code 15"),
        (_patched(GOOD, 32, "<B", 4), "unknown flags"),
        (_patched(GOOD, 36, "<B", 1), "reserved"),
        (_patched(GOOD, 33, "<B", 0), "bytes, not what"),  # a shorter pool name: length off
        (_patched(GOOD, SHAPE0, "<q", -4), "negative"),
        (_patched(GOOD, SHAPE0, "<q", 5), "is not its 128 bytes"),
        (_patched(GOOD, 24, "<Q", 129), "is not its 129 bytes"),
        (_patched(GOOD, SHAPE0, "<q", 1 << 62), "overflows|is not its"),
        (_patched(GOOD, STRIDE0, "<q", 9), "reach past"),
        (_patched(GOOD, STRIDE0, "<q", 1 << 62), "overflow|reach past"),
        (GOOD.replace(b"omni-run-a-cuda0", b"omni-run/a-cuda0"), "name"),
        (GOOD.replace(b"omni-run-a-cuda0", b"omni-run\na-cuda0"), "name"),
    ],
)
def test_hostile_bytes_are_refused(data, reason):
    with pytest.raises(tr.BadRecord, match=reason):
        _decode(data)


def test_random_corruption_never_yields_a_tensor_outside_its_bytes():
    """Every byte flip of a record either is refused or still describes a tensor whose
    elements lie inside its nbytes (what the C checks guarantee)."""
    rnd = random.Random(7)
    good = _encode(_record((3, 5, 7), "int16", "frames"))
    accepted = 0
    for _ in range(3000):
        raw = bytearray(good)
        for _ in range(rnd.randint(1, 4)):
            raw[rnd.randrange(len(raw))] = rnd.randrange(256)
        try:
            got = _decode(bytes(raw))
        except tr.BadRecord:
            continue
        accepted += 1
        item = torch.empty((), dtype=getattr(torch, got["dtype"])).element_size()
        numel = 1
        for d in got["shape"]:
            numel *= d
        assert numel * item == got["nbytes"]
        if numel:
            last = sum((d - 1) * s for d, s in zip(got["shape"], got["strides"], strict=True))
            assert 0 <= last < numel
    assert accepted > 0  # flips of the handles or the slot are well-formed records


def _check_block(rec, pool_bytes=1 << 20, slots=8, mem=MEM, event=EVENT) -> None:
    if lib.omni_trec_check_block(rec, pool_bytes, slots, mem, event) != lib.OMNI_OK:
        raise tr.BadRecord(ffi.string(lib.omni_last_error()).decode())


def test_a_record_must_name_a_block_of_its_pool():
    _check_block(_record())  # the good one
    with pytest.raises(tr.BadRecord, match="slot 3 of 3"):
        _check_block(_record(), slots=3)
    with pytest.raises(tr.BadRecord, match="not a block"):
        _check_block(_record(offset=1000))  # not on a 512-byte boundary
    with pytest.raises(tr.BadRecord, match="not a block"):
        _check_block(_record(offset=(1 << 20) - 512, shape=(1024,)))  # past the pool's end
    with pytest.raises(tr.BadRecord, match="not a block"):
        _check_block(_record(offset=(1 << 64) - 512))  # offset + nbytes wraps around
    with pytest.raises(tr.BadRecord, match="memory handle"):
        _check_block(_record(), mem=bytes(64))  # a pool re-created under the same name
    with pytest.raises(tr.BadRecord, match="event handle"):
        _check_block(_record(), event=bytes(64))


def test_encode_refuses_what_it_cannot_carry():
    with pytest.raises(tr.BadRecord, match="name"):
        tr.set_name(tr.new(), "key", "k" * (tr.NAME_MAX + 1))
    rec = _record()
    rec.nbytes += 2
    with pytest.raises(tr.BadRecord, match="is not its"):
        _encode(rec)
    rec = _record()
    rec.flags = 8
    with pytest.raises(tr.BadRecord, match="unknown flags"):
        _encode(rec)
    rec = _record()
    rec.pool = b"\0"
    with pytest.raises(tr.BadRecord, match="name"):
        _encode(rec)


def test_the_view_gives_its_block_back_when_the_last_tensor_sharing_it_is_freed():
    host = torch.arange(4096, dtype=torch.uint8)
    rec = _record((4, 8), "float32", "t", offset=512)
    host.view(torch.float32)[128 : 128 + 32] = torch.arange(32, dtype=torch.float32)
    state, live = ffi.new("uint32_t *", 2), ffi.new("uint64_t *")
    tensor = tr.view(rec, host.data_ptr(), cuda=False, stream=0, state=state, live=live)
    assert tensor.dtype == torch.float32 and tensor.shape == (4, 8)
    assert tensor.data_ptr() == host.data_ptr() + 512  # the block itself, not a copy
    assert tensor.flatten().tolist() == list(range(32))
    assert live[0] == 1 and state[0] == 2
    row = tensor[1]  # a view of the same storage: the block stays taken while it lives
    del tensor
    assert state[0] == 2 and live[0] == 1
    assert row.tolist() == list(range(8, 16))
    del row
    assert state[0] == 0 and live[0] == 0


def test_a_view_of_a_bad_geometry_is_refused_before_any_tensor():
    rec = _record()
    rec.strides[0] = 100
    state, live = ffi.new("uint32_t *", 2), ffi.new("uint64_t *")
    with pytest.raises(tr.BadRecord, match="reach past"):
        tr.view(rec, 4096, cuda=False, stream=0, state=state, live=live)
    assert live[0] == 0 and state[0] == 2


def _export(rec, state, event_handle=EVENT) -> tuple[int, bytes]:
    out, length = ffi.new("char[]", tr.record_bytes(tr.MAX_DIMS)), ffi.new("uint64_t *")
    rc = lib.omni_trec_export(rec, 1 << 30, 0, 0, 0, event_handle, state, out, len(out), length)
    return rc, ffi.buffer(out, length[0])[:]


def test_the_one_call_export_refuses_a_record_before_any_gpu_work():
    """omni_trec_export encodes first: a record it cannot carry is refused (EINVAL, with the
    reason) and the slot is never marked in flight."""
    state = ffi.new("uint32_t *", 0)
    rec = _record()
    rec.nbytes += 2
    rc, _ = _export(rec, state)
    assert rc == lib.OMNI_EINVAL and "is not its" in ffi.string(lib.omni_last_error()).decode()
    assert state[0] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_the_one_call_export_without_cuda_leaves_the_slot_free():
    state = ffi.new("uint32_t *", 0)
    rc, data = _export(_record(), state, event_handle=bytes(range(100, 164)))
    assert rc == lib.OMNI_ENOCUDA and state[0] == 0
    assert _decode(data)["event_handle"] == bytes(range(100, 164))  # the slot's handle, copied


def _accept(rec, states, slots=8, device=0, mem=MEM, event=1) -> int:
    handles = EVENT * slots  # every slot's event handle
    out, live = ffi.new("void **"), ffi.new("uint64_t *")
    return lib.omni_trec_accept(
        rec, 1 << 20, slots, device, mem, handles, states, event, 1 << 30, 0, live, out
    )


def _refusal() -> str:
    return ffi.string(lib.omni_last_error()).decode()


def test_the_one_call_accept_checks_the_block_and_refuses_a_replay():
    """omni_trec_accept refuses (EINVAL, state unchanged) a slot past the pool's, another
    pool's memory handle, another device, a missing event and a block not in flight: a
    replayed record (its slot already opened, 2) and one never sent (0)."""
    states = ffi.new("uint32_t[]", [1] * 8)
    rec = _record()
    assert _accept(rec, states, slots=3) == lib.OMNI_EINVAL and "slot 3 of 3" in _refusal()
    assert _accept(rec, states, mem=bytes(64)) == lib.OMNI_EINVAL and "memory" in _refusal()
    assert _accept(rec, states, device=1) == lib.OMNI_EINVAL and "cuda:1" in _refusal()
    assert _accept(rec, states, event=0) == lib.OMNI_EINVAL and "no event" in _refusal()
    assert list(states) == [1] * 8
    for state in (2, 0):
        states[3] = state
        assert _accept(rec, states) == lib.OMNI_EINVAL and "not in flight" in _refusal()
        assert states[3] == state


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_the_one_call_accept_gives_the_block_back_when_it_cannot_open_it():
    """A record that checks out takes its slot (1 -> 2); when the stream wait then fails (no
    CUDA here) the block goes straight back to the producer (0), never left opened."""
    states = ffi.new("uint32_t[]", [1] * 8)
    assert _accept(_record(), states) == lib.OMNI_ENOCUDA
    assert states[3] == 0 and states[2] == 1
