"""What a stream costs its receiver's core: records at a fixed gap from a producer process to a
consumer's `pop_async` (one asyncio loop, as a stage host receives), for two code trees (or
settings) against each other, interleaved, each variant a fresh pair of processes.

    python3 tools/device/ring_cpu_cost.py --variant before=/repo --variant after=.dev/x \\
        --gaps-us 10000,2000,500,200 --seconds 1 --rounds 2

Prints a table per gap and variant: the consumer's CPU seconds per second of the stream
(`time.process_time` over the wall time from the first record to the last), its poll bound at
the end where the tree has one, and the record's latency (push to pop, median / p90 us). The
producer's CPU (its pacing, the doorbell it rings) is not counted.
"""

from __future__ import annotations

import argparse
import os
import sys

from variants import carried_paths, parse, pct, run_child

_PRODUCER = """
import struct, sys, time
from omni_transport import Ring
ring = Ring.attach(sys.argv[1], role="producer")
gap, n = float(sys.argv[2]) * 1e-6, int(sys.argv[3])
time.sleep(0.05)
due = time.perf_counter()
for i in range(n):
    due += gap
    left = due - time.perf_counter()
    if left > 0:
        time.sleep(left)
    ring.push(struct.pack("<d", time.perf_counter()))
time.sleep(0.2)
ring.close()
"""

_CONSUMER = """
import asyncio, json, os, struct, subprocess, sys, time
from omni_transport import Ring
from omni_transport.ring import unique_name

async def main(gap_us, n):
    ring = Ring.create(unique_name("omni-cpu-"), 1 << 20, role="consumer")
    prod = subprocess.Popen([sys.executable, "-c", sys.argv[3], ring.name, str(gap_us), str(n)])
    lat = []
    try:
        for i in range(n):
            with await asyncio.wait_for(ring.pop_async(), 30) as rec:
                now = time.perf_counter()
                lat.append((now - struct.unpack("<d", bytes(rec.header))[0]) * 1e6)
            if i == 0:  # the clock starts at the first record (process start-up excluded)
                wall0, cpu0 = now, time.process_time()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        bound = getattr(ring, "hot_poll_us", None)
    finally:
        prod.wait(30)
        ring.close()
    print("RESULT " + json.dumps({"cpu": cpu / wall, "lat": lat[1:], "bound": bound}))

asyncio.run(main(float(sys.argv[1]), int(sys.argv[2])))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", action="append", required=True, help="NAME=TREE[:ENV=V,...]")
    ap.add_argument("--gaps-us", default="10000,2000,500,200")
    ap.add_argument("--seconds", type=float, default=1.0, help="per gap, variant and round")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    variants = parse(args.variant)
    gaps = [float(g) for g in args.gaps_us.split(",")]
    res: dict[tuple[float, str], dict[str, list]] = {}
    keep = carried_paths()
    for r in range(args.rounds):
        for gap in gaps:
            n = max(50, int(args.seconds * 1e6 / gap))
            for name, tree, extra in variants:
                path = ":".join([f"{tree}/transport_ext", *keep])
                env = {**os.environ, **extra, "PYTHONPATH": path}
                cmd = [sys.executable, "-c", _CONSUMER, str(gap), str(n), _PRODUCER]
                one, _, failed = run_child(cmd, env, 120)
                if failed:
                    print(f"{name} gap {gap}: failed {failed}")
                    return 1
                cell = res.setdefault((gap, name), {"cpu": [], "lat": [], "bound": []})
                cell["cpu"].append(one["cpu"])
                cell["lat"].extend(one["lat"])
                cell["bound"].append(one["bound"])
        print(f"round {r} done", flush=True)
    print()
    print(f"{args.rounds} rounds of ~{args.seconds:g} s per gap and variant, interleaved; the "
          "consumer's CPU per second of stream (each round), latency median / p90 us:")  # fmt: skip
    print()
    print("| gap | variant | receiver CPU s/s | poll bound at the end (us) | latency (us) |")
    print("|---|---|---|---|---|")
    for gap in gaps:
        for name, _, _ in variants:
            c = res[(gap, name)]
            cpu = " / ".join(f"{v:.3f}" for v in c["cpu"])
            bound = " / ".join("-" if b is None else f"{b:.0f}" for b in c["bound"])
            lat = f"{pct(c['lat'], 0.5):.0f} / {pct(c['lat'], 0.9):.0f}"
            print(f"| {gap / 1000:g} ms | {name} | {cpu} | {bound} | {lat} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
