"""The crossing alone, two code trees (or settings) against each other, interleaved: each round
runs every variant in turn, each in a fresh process with that tree on PYTHONPATH, so the load
of the machine falls on all alike. Uses omni_bench.gpu_handoff's crossing (two runtime
`Endpoint`s at their defaults, `send_data` to the receiver's loop holding the usable tensor),
which every tree compared has.

    python3 tools/device/crossing_ab.py --variant main=/repo --variant branch=.dev/x \\
        --variant branch-spin0=.dev/x:OMNI_RING_HOT_SPIN_US=0 --rounds 2 --sizes-mib 1,64

Prints a table: per size and variant, crossing / sender's encode / receiver's side, median /
p90 microseconds over all rounds.
"""

from __future__ import annotations

import argparse
import os
import sys

from variants import carried_paths, parse, pct, run_child

_CHILD = """
import asyncio, json, sys
from omni_bench.gpu_handoff import _cross
out = {}
for mib in sys.argv[1].split(","):
    out[mib] = asyncio.run(_cross(int(float(mib) * (1 << 20)), int(sys.argv[2]), int(sys.argv[3])))
print("RESULT " + json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", action="append", required=True, help="NAME=TREE[:ENV=V,...]")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sizes-mib", default="1,64")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    variants = parse(args.variant)
    res: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in range(args.rounds):
        for name, tree, extra in variants:
            paths = [f"{tree}/{p}" for p in ("server", "tools", "clients", "transport_ext")]
            env = {**os.environ, **extra, "PYTHONPATH": ":".join(paths + carried_paths())}
            cmd = [sys.executable, "-c", _CHILD, args.sizes_mib, str(args.requests),
                   str(args.warmup)]  # fmt: skip
            result, stdout, failed = run_child(cmd, env, 300)
            if failed:
                print(f"{name} round {r}: failed {failed}")
                return 1
            for mib, one in result.items():
                for k, v in one.items():
                    res.setdefault((mib, name), {}).setdefault(k, []).extend(v)
            notes = sorted({x for x in stdout.splitlines() if x.startswith("NOTE ")})
            print(f"round {r} {name} done", *notes, sep="\n  ", flush=True)
    print()
    print(f"{args.rounds} x {args.requests} crossings per variant and size after {args.warmup} "
          "warm-up each, interleaved; median / p90, microseconds:")  # fmt: skip
    print()
    print("| tensor | variant | crossing | encode (sender) | receiver (ring, wake-up, decode) |")
    print("|---|---|---|---|---|")
    for mib in args.sizes_mib.split(","):
        for name, _, _ in variants:
            cells = [f"{pct(res[(mib, name)][k], 0.5):.0f} / {pct(res[(mib, name)][k], 0.9):.0f}"
                     for k in ("crossing", "encode", "receiver")]  # fmt: skip
            print(f"| {mib} MiB | {name} | " + " | ".join(cells) + " |")
    parts = [(mib, name) for mib in args.sizes_mib.split(",") for name, _, _ in variants
             if res[(mib, name)].get("export")]  # fmt: skip
    if parts:  # trees whose crossing stamps the push (since 2026-12-02)
        print()
        print("| tensor | variant | encode: export (codec, lane, pool, C) | encode: ring push |")
        print("|---|---|---|---|")
        for mib, name in parts:
            cells = [f"{pct(res[(mib, name)][k], 0.5):.0f} / {pct(res[(mib, name)][k], 0.9):.0f}"
                     for k in ("export", "push")]  # fmt: skip
            print(f"| {mib} MiB | {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
