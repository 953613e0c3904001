"""The echo end of a contention test, run as its own process (python contention_peer.py ...).

Pins itself to one CPU (where the test also pins a process that spins: a hog), then pops each
record of the data ring, checks its sequence number and payload, releases it and pushes the
sequence number back on the ack ring. Prints one JSON line at the end: what it received, and the
data ring's Ring.wait_counts. Exit status: 0 done, 1 a record out of order or corrupt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import sys

from omni_transport import Record, Ring

SEQ = struct.Struct("<Q")


def payload(seq: int) -> bytes:
    """Record seq's payload: 0-191 bytes derived from seq (the test builds the same)."""
    return bytes((seq + i) & 0xFF for i in range(seq % 192))


def check(rec: Record, expected: int) -> None:
    (seq,) = SEQ.unpack(rec.header)
    if seq != expected:
        raise AssertionError(f"record {expected}: got sequence number {seq}")
    if bytes(rec.buffers[0]) != payload(seq):
        raise AssertionError(f"record {seq}: payload differs")


def echo(data: Ring, ack: Ring, count: int) -> None:
    for seq in range(count):
        with data.pop(timeout=60) as rec:
            check(rec, seq)
        ack.push(SEQ.pack(seq), timeout=60)


async def echo_async(data: Ring, ack: Ring, count: int) -> None:
    for seq in range(count):
        with await asyncio.wait_for(data.pop_async(), 60) as rec:
            check(rec, seq)
        await asyncio.wait_for(ack.push_async(SEQ.pack(seq)), 60)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("ack")
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--cpu", type=int, required=True)
    ap.add_argument("--mode", choices=("pop", "pop_async"), default="pop")
    ap.add_argument("--no-check", action="store_true", help="contention_check = False")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.cpu})
    data = Ring.attach(args.data, role="consumer")
    ack = Ring.attach(args.ack, role="producer")
    data.contention_check = ack.contention_check = not args.no_check
    summary: dict[str, object] = {}
    code = 0
    try:
        if args.mode == "pop":
            echo(data, ack, args.count)
        else:
            asyncio.run(echo_async(data, ack, args.count))
        summary["received"] = args.count
    except AssertionError as e:
        summary["corrupt"] = str(e)
        code = 1
    finally:
        summary["wait_counts"] = data.wait_counts
        data.close()
        ack.close()
    print(json.dumps(summary), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
