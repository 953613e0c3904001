"""`omni-bench soak`: requests under injected faults, bounded in count and time, loopback only.

A server on the repository takes N speech requests at concurrency C while a chaos loop SIGKILLs
or SIGSTOPs a random stage process every few seconds (a SIGSTOPped one stays frozen: the
supervisor's heartbeats must find and kill it). Reported: requests ok and failed by status and
error code; per fault, its kind, its victim and the time until /health said "ok" again; and
processes, /dev/shm segments, descriptors, run directories and RSS of the server's run before
and after, and what of its run is left once it stopped (every fault must be recovered and
nothing may leak).

    omni-bench soak [--repo repository] [--requests 1000] [--concurrency 8] [--faults 10]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from omni_bench.harness import tables
from omni_bench.harness.server import OmniServer, run_segments
from omni_bench.harness.timing import closed_loop
from omni_server.compiler import compile_repository

TEXT = "The quick brown fox jumps over the lazy dog."
RECOVERY_TIMEOUT_S = 60.0


@dataclass
class Fault:
    kind: str  # SIGKILL | SIGSTOP
    victim: str  # instance name
    at: float
    detected_s: float | None = None  # /health left "ok" (a frozen process: its heartbeats)
    recovered_s: float | None = None  # /health said "ok" again


@dataclass
class Resources:
    """What the server's run holds at one moment."""

    stage_processes: int
    segments: int  # of this run (/dev/shm/omni-RUN_ID-*)
    fds: int
    run_dirs: int  # of this run
    rss_mib: float

    @classmethod
    def of(cls, server: OmniServer) -> Resources:
        assert server.pid is not None
        rss = 0.0
        for line in Path(f"/proc/{server.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
        stages = server.see_stage_processes()
        runs = {(p.run_dir, p.run_id) for p in stages}
        return cls(
            stage_processes=len(stages),
            segments=sum(len(run_segments(run_id)) for _, run_id in runs),
            fds=len(os.listdir(f"/proc/{server.pid}/fd")),
            run_dirs=sum(1 for run_dir, _ in runs if run_dir.exists()),
            rss_mib=rss,
        )


async def _load(url: str, requests: int, concurrency: int, outcomes: collections.Counter) -> None:
    body = {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "pcm"}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def one(_: int) -> None:
            try:
                async with http.post(f"{url}/v1/audio/speech", json=body) as r:
                    if r.status == 200:
                        await r.read()  # a stream cut midway raises here
                        outcomes["200 ok"] += 1
                    else:
                        code = (await r.json()).get("error", {}).get("code")
                        outcomes[f"{r.status} {code}"] += 1
            except (aiohttp.ClientError, TimeoutError) as err:
                outcomes[f"cut: {type(err).__name__}"] += 1

        await closed_loop(range(requests), concurrency, one)


async def _chaos(
    server: OmniServer, names: list[str], args, faults: list[Fault], done: asyncio.Event
) -> None:
    rng = random.Random(args.seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while len(faults) < args.faults and not done.is_set():
            await asyncio.sleep(args.fault_interval)
            stages = server.see_stage_processes()
            if not stages:
                continue
            victim = rng.choice(stages)
            kind = rng.choice(("SIGKILL", "SIGSTOP"))
            fault = Fault(kind, names[victim.instance], time.monotonic())
            os.kill(victim.pid, signal.SIGKILL if kind == "SIGKILL" else signal.SIGSTOP)
            faults.append(fault)
            # detected: /health leaves "ok"; recovered: it says "ok" again (every instance up)
            while time.monotonic() - fault.at < RECOVERY_TIMEOUT_S:
                ok = await _health_ok(http, server.url)
                if fault.detected_s is None and not ok:
                    fault.detected_s = time.monotonic() - fault.at
                elif fault.detected_s is not None and ok:
                    fault.recovered_s = time.monotonic() - fault.at
                    break
                await asyncio.sleep(0.05)


async def _health_ok(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with http.get(f"{url}/health") as r:
            return r.status == 200 and (await r.json())["status"] == "ok"
    except (aiohttp.ClientError, TimeoutError):
        return False


async def run(args) -> str:
    names = [instance.name for instance in compile_repository(args.repo).instances]
    server = OmniServer(args.repo, ready_timeout_s=600)
    await server.start()
    outcomes: collections.Counter[str] = collections.Counter()
    faults: list[Fault] = []
    try:
        before = Resources.of(server)
        done = asyncio.Event()
        chaos = asyncio.create_task(_chaos(server, names, args, faults, done))
        started = time.monotonic()
        await asyncio.wait_for(
            _load(server.url, args.requests, args.concurrency, outcomes), args.timeout_s
        )
        wall = time.monotonic() - started
        done.set()
        await chaos
        after = Resources.of(server)
    finally:
        await server.stop()
    left = server.left
    recovered = [f.recovered_s for f in faults if f.recovered_s is not None]
    nan = float("nan")
    lines = [
        f"{args.requests} speech requests at concurrency {args.concurrency} in {wall:.0f} s, "
        f"{len(faults)} faults ({args.fault_interval:g} s apart, seed {args.seed})",
        "",
        *tables.header(["outcome", "requests"], "lr"),
        *(tables.row([k, v]) for k, v in sorted(outcomes.items())),
        "",
        *tables.header(["fault", "victim", "detected in s", "recovered in s"], "llrr"),
        *(tables.row([f.kind, f.victim, _s(f.detected_s), _s(f.recovered_s)]) for f in faults),
        "",
        f"recovery: {len(recovered)}/{len(faults)} faults, median "
        f"{statistics.median(recovered) if recovered else nan:.2f} s, max "
        f"{max(recovered) if recovered else nan:.2f} s",
        "",
        *tables.header(["resource", "before", "after the faults", "after stop"], "lrrr"),
        tables.row(
            ["stage processes", before.stage_processes, after.stage_processes, len(left.processes)]
        ),
        tables.row(
            [
                "/dev/shm omni-* segments",
                before.segments,
                after.segments,
                f"{len(left.segments):+d}",
            ]
        ),
        tables.row(["server fds", before.fds, after.fds, "-"]),
        tables.row(
            ["run directories", before.run_dirs, after.run_dirs, f"{len(left.run_dirs):+d}"]
        ),
        tables.row(["server RSS MiB", f"{before.rss_mib:.0f}", f"{after.rss_mib:.0f}", "-"]),
    ]
    return "\n".join(lines)


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-bench soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path("repository"))
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument("--fault-interval", type=float, default=3.0, help="seconds between faults")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=3600, help="bound on the whole load")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.faults < 0:
        parser.error("--requests and --concurrency must be >= 1, --faults >= 0")
    print(asyncio.run(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
