"""`omni-bench soak`: requests under injected faults, bounded in count and time, loopback only.

A server on the repository takes N speech requests at concurrency C while a chaos loop SIGKILLs
or SIGSTOPs a random stage process every few seconds (a SIGSTOPped one stays frozen: the
supervisor's heartbeats must find and kill it). Reported: requests ok and failed by status and
error code; per fault, its kind, its victim and the time until /health said "ok" again; and
processes, /dev/shm segments, descriptors, run directories and RSS of the server before and
after (every fault must be recovered and nothing may leak).

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
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from omni_bench.child_server import ChildServer
from omni_server.compiler.compiler import compile_repository

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
    stage_processes: int
    segments: int
    fds: int
    run_dirs: int
    rss_mib: float

    @classmethod
    def of(cls, server_pid: int) -> Resources:
        rss = 0.0
        for line in Path(f"/proc/{server_pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
        return cls(
            stage_processes=len(_workers(server_pid)),
            segments=sum(1 for n in os.listdir("/dev/shm") if n.startswith("omni-")),
            fds=len(os.listdir(f"/proc/{server_pid}/fd")),
            run_dirs=len(list(Path(tempfile.gettempdir()).glob("omni-run-*"))),
            rss_mib=rss,
        )


def _workers(server_pid: int) -> dict[int, int]:
    """pid -> plan instance index of the server's stage processes."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = next((int(x.split()[1]) for x in status.splitlines() if x.startswith("PPid:")), 0)
        if ppid == server_pid and b"omni_server.stage.worker" in argv:
            out[int(entry)] = int(argv[argv.index(b"omni_server.stage.worker") + 3])
    return out


async def _load(url: str, requests: int, concurrency: int, outcomes: collections.Counter) -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    body = {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "pcm"}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
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

        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _chaos(
    server_pid: int, url: str, names: list[str], args, faults: list[Fault], done: asyncio.Event
) -> None:
    rng = random.Random(args.seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while len(faults) < args.faults and not done.is_set():
            await asyncio.sleep(args.fault_interval)
            workers = _workers(server_pid)
            if not workers:
                continue
            pid = rng.choice(sorted(workers))
            kind = rng.choice(("SIGKILL", "SIGSTOP"))
            fault = Fault(kind, names[workers[pid]], time.monotonic())
            os.kill(pid, signal.SIGKILL if kind == "SIGKILL" else signal.SIGSTOP)
            faults.append(fault)
            # detected: /health leaves "ok"; recovered: it says "ok" again (every instance up)
            while time.monotonic() - fault.at < RECOVERY_TIMEOUT_S:
                ok = await _health_ok(http, url)
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
    plan = compile_repository(args.repo)
    names = [instance.name for instance in plan.instances]
    before_run_dirs = len(list(Path(tempfile.gettempdir()).glob("omni-run-*")))
    segments_before = sum(1 for n in os.listdir("/dev/shm") if n.startswith("omni-"))
    server = ChildServer(
        "omni-server",
        lambda port: [
            sys.executable,
            "-m",
            "omni_server",
            "--repo",
            str(args.repo),
            "--port",
            str(port),
        ],
        "/health/ready",
        ready_timeout_s=600,
    )
    await server.start()
    assert server.pid is not None
    outcomes: collections.Counter[str] = collections.Counter()
    faults: list[Fault] = []
    try:
        before = Resources.of(server.pid)
        done = asyncio.Event()
        chaos = asyncio.create_task(_chaos(server.pid, server.url, names, args, faults, done))
        started = time.monotonic()
        await asyncio.wait_for(
            _load(server.url, args.requests, args.concurrency, outcomes), args.timeout_s
        )
        wall = time.monotonic() - started
        done.set()
        await chaos
        after = Resources.of(server.pid)
    finally:
        await server.stop()
    left = Resources(0, 0, 0, 0, 0.0)
    left.segments = (
        sum(1 for n in os.listdir("/dev/shm") if n.startswith("omni-")) - segments_before
    )
    left.run_dirs = len(list(Path(tempfile.gettempdir()).glob("omni-run-*"))) - before_run_dirs
    recovered = [f.recovered_s for f in faults if f.recovered_s is not None]
    lines = [
        f"{args.requests} speech requests at concurrency {args.concurrency} in {wall:.0f} s, "
        f"{len(faults)} faults ({args.fault_interval:g} s apart, seed {args.seed})",
        "",
        "| outcome | requests |",
        "|---|---:|",
        *(f"| {k} | {v} |" for k, v in sorted(outcomes.items())),
        "",
        "| fault | victim | detected in s | recovered in s |",
        "|---|---|---:|---:|",
        *(f"| {f.kind} | {f.victim} | {_s(f.detected_s)} | {_s(f.recovered_s)} |" for f in faults),
        "",
        f"recovery: {len(recovered)}/{len(faults)} faults, median "
        f"{statistics.median(recovered) if recovered else float('nan'):.2f} s, max "
        f"{max(recovered) if recovered else float('nan'):.2f} s",
        "",
        "| resource | before | after the faults | after stop |",
        "|---|---:|---:|---:|",
        f"| stage processes | {before.stage_processes} | {after.stage_processes} | - |",
        f"| /dev/shm omni-* segments | {before.segments} | {after.segments} | {left.segments:+d} |",
        f"| server fds | {before.fds} | {after.fds} | - |",
        f"| run directories | {before.run_dirs} | {after.run_dirs} | {left.run_dirs:+d} |",
        f"| server RSS MiB | {before.rss_mib:.0f} | {after.rss_mib:.0f} | - |",
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
