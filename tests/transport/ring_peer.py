"""One end of a stress-test ring, run as its own process (python ring_peer.py ...).

Records are drawn from a seeded generator both ends share: the producer sends record i built
from slices of a common random pool, with its sequence number and CRC32s in the header; the
consumer checks order, sizes and checksums. Prints one JSON line with what it saw at the end.
Exit status: 0 done, 3 the peer closed or died (expected in the kill runs), 1 corruption.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys
import zlib

import numpy as np

from omni_transport import Ring, RingClosed

POOL_BYTES = 8 << 20
HEAD = struct.Struct("<QI")  # sequence number, buffer count; then one u32 CRC per buffer


def record_sizes(rng: random.Random) -> list[int]:
    """Mostly small records, some medium, a few of several MiB (the ring is 8 MiB)."""
    n = rng.choice((0, 1, 1, 1, 2, 3))
    sizes = []
    for _ in range(n):
        r = rng.random()
        if r < 0.90:
            sizes.append(rng.randint(0, 256))
        elif r < 0.997:
            sizes.append(rng.randint(257, 64 << 10))
        else:
            sizes.append(rng.randint(1 << 20, 5 << 20))
    return sizes


def produce(ring: Ring, count: int, seed: int, pool: memoryview) -> dict[str, int]:
    rng = random.Random(seed)
    sent = nbytes = 0
    for seq in range(count):
        bufs = []
        for size in record_sizes(rng):
            off = rng.randint(0, POOL_BYTES - size)
            bufs.append(pool[off : off + size])
        crcs = [zlib.crc32(b) for b in bufs]
        header = HEAD.pack(seq, len(bufs)) + struct.pack(f"<{len(bufs)}I", *crcs)
        ring.push(header, bufs)
        sent += 1
        nbytes += sum(len(b) for b in bufs)
    return {"sent": sent, "bytes": nbytes}


def consume(ring: Ring, count: int) -> dict[str, int]:
    got = nbytes = 0
    held: list = []
    rng = random.Random(7)
    while got < count:
        rec = ring.pop(timeout=60)
        seq, n = HEAD.unpack_from(rec.header)
        crcs = struct.unpack_from(f"<{n}I", rec.header, HEAD.size)
        if seq != got or len(rec.buffers) != n:
            raise AssertionError(f"record {got}: got seq {seq} with {len(rec.buffers)}/{n} buffers")
        for i, (buf, crc) in enumerate(zip(rec.buffers, crcs, strict=True)):
            if zlib.crc32(buf) != crc:
                raise AssertionError(f"record {seq} buffer {i}: checksum mismatch")
            nbytes += buf.nbytes
        got += 1
        # hold a few records at times, to exercise out-of-order release and a fuller ring
        held.append(rec)
        if len(held) > rng.randint(0, 3):
            for r in reversed(held):
                r.release()
            held.clear()
    return {"received": got, "bytes": nbytes}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=("producer", "consumer"))
    ap.add_argument("name")
    ap.add_argument("--create", action="store_true")
    ap.add_argument("--count", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capacity", type=int, default=8 << 20)
    args = ap.parse_args()
    fds_before = len(os.listdir("/proc/self/fd"))
    if args.create:
        ring = Ring.create(args.name, args.capacity, role=args.role)
    else:
        ring = Ring.attach(args.name, role=args.role)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    summary: dict[str, object] = {"role": args.role}
    code = 0
    try:
        if args.role == "producer":
            pool = memoryview(np.random.default_rng(args.seed).bytes(POOL_BYTES))
            summary.update(produce(ring, args.count, args.seed, pool))
        else:
            summary.update(consume(ring, args.count))
    except RingClosed as e:
        summary["closed"] = str(e)
        code = 3
    except AssertionError as e:
        summary["corrupt"] = str(e)
        code = 1
    finally:
        ring.close()
    summary["fds_leaked"] = len(os.listdir("/proc/self/fd")) - fds_before
    print(json.dumps(summary), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
