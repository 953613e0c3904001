"""Runtime overhead: an empty 3-stage pipeline (a -> b -> c, backends return their inputs), so
everything measured is the framework: admission, scheduling, compute-thread hand-offs, transport
between stages, and the coordinator.

    omni-bench overhead [--requests 2000] [--concurrency 1,2,4,8,16,32,64] [--payload-kib 0]
                        [--layouts inline,one-process,split] [--scheduler single|batch]

Layouts: `inline` (stage hosts on the caller's loop, objects passed), `one-process` (all three
stages in one stage process: objects passed between them, the ring to and from the coordinator),
`split` (one process per stage: every hop crosses a shared-memory ring). Closed loop: `c`
clients each submit their next request when the previous one completes. Prints requests/s and
latency per level; at c=1 the mean latency is the framework's cost of one request.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from omni_bench.harness import tables
from omni_bench.harness.timing import closed_loop, percentile
from omni_server.compiler import Plan, compile_repository
from omni_server.pipeline import Runtime

LAYOUTS = {
    "inline": ("p", "p", "p"),
    "one-process": ("p", "p", "p"),
    "split": ("a", "b", "c"),
}

EMPTY_STAGE = Path(__file__).with_name("empty_stage.py")  # the backend of every stage


def empty_pipeline(root: Path, layout: str, scheduler: str) -> Plan:
    procs = LAYOUTS[layout]
    wiring = ['next = "b"', 'next = "c"', "terminal = true"]
    sched = {
        "single": "",
        "batch": '[scheduler]\nkind = "batch"\nmax_batch_size = 64\nmax_queue_delay_ms = 0\n',
    }[scheduler]
    for name, process, wire in zip("abc", procs, wiring, strict=True):
        folder = root / name
        folder.mkdir(parents=True)
        toml = f'backend = "model.py:Empty"\nprocess = "{process}"\n{wire}\n{sched}'
        (folder / "stage.toml").write_text(toml)
        shutil.copyfile(EMPTY_STAGE, folder / "model.py")
    (root / "repository.toml").write_text('[models.empty]\nentry = "a"\ntasks = ["speech"]\n')
    return compile_repository(root)


async def measure(runtime: Runtime, concurrency: int, requests: int, payload: dict) -> dict:
    model = runtime.plan.models["empty"]
    latencies: list[float] = []

    async def one(_: int) -> None:
        start = time.perf_counter()
        await runtime.submit(model, payload).result()
        latencies.append(time.perf_counter() - start)

    # warm-up: first messages attach rings, first calls start threads
    await asyncio.gather(*(runtime.submit(model, payload).result() for _ in range(32)))
    elapsed = await closed_loop(range(requests), concurrency, one)
    return {
        "concurrency": concurrency,
        "rps": len(latencies) / elapsed,
        "mean_ms": statistics.fmean(latencies) * 1000,
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
    }


async def run(args: argparse.Namespace) -> list[tuple[str, dict]]:
    payload: dict = {"text": "hello"}
    if args.payload_kib:
        payload["array"] = np.zeros(args.payload_kib * 256, dtype=np.float32)
    rows = []
    for layout in args.layouts:
        with tempfile.TemporaryDirectory(prefix="omni-overhead-") as tmp:
            plan = empty_pipeline(Path(tmp), layout, args.scheduler)
            runtime = Runtime(plan, inline=layout == "inline")
            await runtime.start()
            try:
                for c in args.concurrency:
                    row = await measure(runtime, c, args.requests, payload)
                    rows.append((layout, row))
                    print(_line(layout, row), flush=True)
            finally:
                await runtime.stop()
    return rows


COLUMNS = ["layout     ", "  c", "   req/s", "mean ms", " p50 ms", " p99 ms"]


def _line(layout: str, row: dict) -> str:
    ms = (f"{row[k]:>7.2f}" for k in ("mean_ms", "p50_ms", "p99_ms"))
    return tables.row([f"{layout:<11}", f"{row['concurrency']:>3}", f"{row['rps']:>8.0f}", *ms])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="omni-bench overhead",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=2000, help="requests per level")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="levels, comma separated")
    parser.add_argument("--payload-kib", type=int, default=0, help="float32 array per request")
    parser.add_argument(
        "--layouts", default=",".join(LAYOUTS), help="process layouts, comma separated"
    )
    parser.add_argument("--scheduler", choices=("single", "batch"), default="single")
    args = parser.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency: a comma-separated list of integers, got {args.concurrency!r}")
    args.layouts = args.layouts.split(",")
    unknown = [x for x in args.layouts if x not in LAYOUTS]
    if unknown:
        parser.error(f"--layouts: unknown {', '.join(unknown)}; valid: {', '.join(LAYOUTS)}")
    payload = f"{args.payload_kib} KiB array" if args.payload_kib else "a small dict"
    print(
        f"empty 3-stage pipeline, scheduler {args.scheduler}, payload {payload}, "
        f"{args.requests} requests per level"
    )
    print("\n".join(tables.header(COLUMNS, "lrrrrr")))
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
