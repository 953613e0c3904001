"""What each part of the sender's side of the one-tensor crossing costs, on one GPU, in one
process: the driver calls of an export, torch's metadata reads, the whole export and the
whole encode, and the ring push. Runs against whichever tree is on PYTHONPATH (it uses only
public names that main's tree has too), so the same script measures the path before and after.

    python3 tools/device/crossing_parts.py [--reps 500] [--label NAME]

Prints one table row per part: median / p90 nanoseconds of one call, `--reps` calls after 50
warm-up calls.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any


def _time(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    for _ in range(50):
        fn()
    out = []
    clock = time.perf_counter_ns
    for _ in range(reps):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    out.sort()
    return out[len(out) // 2] / 1e3, out[int(len(out) * 0.9)] / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=500)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    import torch

    from omni_server.wire.codec import encode
    from omni_server.wire.cuda_lane import CudaExporter
    from omni_transport import Ring
    from omni_transport.cabi import ffi, lib
    from omni_transport.cuda_ipc import CudaPool

    torch.cuda.set_device(0)
    n = args.reps + 50
    t = torch.full((16384,), 1.0, device="cuda")  # 64 KiB: the parts do not depend on the size
    torch.cuda.synchronize()
    rows: list[tuple[str, tuple[float, float]]] = []
    get_raw, get_dev = torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice
    stream = int(get_raw(get_dev()))
    rows.append(
        ("the raw current stream (torch C accessors)", _time(lambda: get_raw(get_dev()), n))
    )

    def meta() -> Any:
        return (t.dtype, t.dim(), t.data_ptr(), t.is_contiguous(), t.nbytes, t.shape,
                t.stride(), t.get_device(), t.requires_grad)  # fmt: skip

    rows.append(("torch metadata reads (9 of them)", _time(meta, n)))
    dptr = ffi.new("uint64_t *")
    assert lib.omni_cuda_mem_alloc(1 << 20, dptr) == lib.OMNI_OK
    src = t.data_ptr()

    def copy() -> Any:
        return lib.omni_cuda_memcpy_dtod_async(dptr[0], src, 65536, stream)

    rows.append(("cuMemcpyDtoDAsync, 64 KiB (+ context check)", _time(copy, n)))
    ev = ffi.new("uint64_t *")
    assert lib.omni_cuda_event_create_ipc(ev) == lib.OMNI_OK
    rows.append(("cuEventRecord, interprocess event (+ context check)",
                 _time(lambda: lib.omni_cuda_event_record(ev[0], stream), n)))  # fmt: skip
    plain = torch.cuda.Event()
    rows.append(("torch Event().record(), a plain event", _time(plain.record, n)))
    ipc = torch.cuda.Event(interprocess=True)
    rows.append(("torch Event(interprocess=True).record()", _time(ipc.record, n)))
    torch.cuda.synchronize()
    tag = f"omni-parts-{os.getpid()}"
    pool = CudaPool(f"{tag}-pool", 2 * n * 65536 + (1 << 20), slots=1024)
    try:
        rows.append(("CudaPool.export_packed (copy in, event, record)",
                     _time(lambda: pool.export_packed(t, "t"), n)))  # fmt: skip
    finally:
        torch.cuda.synchronize()
        pool.close()
    exporter = CudaExporter(tag, {"b": frozenset({0})})
    lane = exporter.for_receiver("b")
    try:
        rows.append(("codec.encode({'t': tensor}) through the lane",
                     _time(lambda: encode({"t": t}, lane), n)))  # fmt: skip
    finally:
        torch.cuda.synchronize()
        exporter.close()
    ring = Ring.create(f"{tag}-ring", 8 << 20, role="consumer")
    producer = Ring.attach(f"{tag}-ring", role="producer")
    record = bytes(232)
    try:
        rows.append(("Ring.push of a 232-byte record", _time(lambda: producer.push(record), n)))
    finally:
        producer.close()
        ring.close()
    lib.omni_cuda_event_destroy(ev[0])
    lib.omni_cuda_mem_free(dptr[0])
    for what, (p50, p90) in rows:
        print(f"| {args.label} | {what} | {p50:.1f} / {p90:.1f} |", flush=True)


if __name__ == "__main__":
    main()
