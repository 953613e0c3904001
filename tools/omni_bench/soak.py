"""`omni-bench soak`: mixed load under injected faults, bounded in count or time, loopback only.

A server on the repository takes requests at concurrency C, taken in turn from the mix (speech,
transcription, chat, omni, realtime sessions: the embedded repository's models) for N requests
or for `--duration-s`, while a chaos loop SIGKILLs or SIGSTOPs a random stage process every few
seconds (a SIGSTOPped one stays frozen: the supervisor's heartbeats must find and kill it), each
fault waited out (every instance up again, at most --recovery-timeout) before the next.
Reported: requests by kind, status and error code; per fault, its kind, its victim, when
/health first named the victim down and when it no longer did (its successor up), and the
median and max of those per kind of victim process (thinker, voice, asr) and fault; every
process's RSS slope (MB/min, psutil, one series per process: a restarted one starts a new
one); and processes, /dev/shm segments, descriptors and run directories of the server's run
before and after, and what of it is left once it stopped.

    omni-bench soak [--repo repository] [--requests 1000 | --duration-s 1800] [--concurrency 8]
                    [--faults 10] [--mix speech,transcription,chat,omni,realtime]
                    [--victims thinker,voice,asr]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import os
import random
import re
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from omni_bench import soak_mix as mix
from omni_bench.harness import tables
from omni_bench.harness.server import OmniServer, run_segments
from omni_bench.rss import RssSampler
from omni_server.compiler import compile_repository


@dataclass
class Fault:
    kind: str  # SIGKILL | SIGSTOP
    victim: str  # instance name
    at: float
    detected_s: float | None = None  # /health named the victim down (frozen: its heartbeats)
    recovered_s: float | None = None  # /health no longer named it (its successor is up)


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


async def _load(url: str, args, outcomes: collections.Counter) -> None:
    """Closed loop: each of `concurrency` workers sends its next request as soon as its last
    one ended, the kinds in turn, until `requests` were sent or `duration_s` passed."""
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        clip = await mix.speech_clip(http, url)  # the transcription requests' audio
        counter = itertools.count()
        deadline = time.monotonic() + args.duration_s if args.duration_s else None

        async def worker() -> None:
            while True:
                n = next(counter)
                if deadline is None and n >= args.requests:
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    return
                kind = args.mix[n % len(args.mix)]
                try:
                    outcome = await mix.REQUESTS[kind](http, url, clip)
                except (aiohttp.ClientError, TimeoutError) as err:
                    outcome = f"cut: {type(err).__name__}"
                outcomes[f"{kind} {outcome}"] += 1

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))


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
            targets = [p for p in stages if _process(names[p.instance]) in args.victims]
            if not targets:
                continue
            victim = rng.choice(targets)
            kind = rng.choice(("SIGKILL", "SIGSTOP"))
            fault = Fault(kind, names[victim.instance], time.monotonic())
            os.kill(victim.pid, signal.SIGKILL if kind == "SIGKILL" else signal.SIGSTOP)
            faults.append(fault)
            # detected: /health names the victim down; recovered: it no longer does (its
            # successor is up). Then every instance must be up before the next fault, so one
            # fault's recovery is never another's.
            while time.monotonic() - fault.at < args.recovery_timeout:
                down = await _down(http, server.url)
                now = time.monotonic() - fault.at
                if down is None:  # no answer: nothing learnt
                    pass
                elif fault.detected_s is None and fault.victim in down:
                    fault.detected_s = now
                elif fault.detected_s is not None and fault.victim not in down:
                    fault.recovered_s = fault.recovered_s or now
                if fault.recovered_s is not None and down == set():
                    break
                await asyncio.sleep(0.05)


_DOWN = re.compile(r"([A-Za-z0-9_.-]+@r\d+) (?:restarting|failed)")


async def _down(http: aiohttp.ClientSession, url: str) -> set[str] | None:
    """The instances /health names down (restarting or failed; empty: "ok"), or None when it
    did not answer."""
    try:
        async with http.get(f"{url}/health") as r:
            body = await r.json()
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    return named_down(body)


def named_down(health: dict) -> set[str]:
    """The instances a /health body names restarting or failed (none when it says "ok")."""
    if health.get("status") == "ok":
        return set()
    return set(_DOWN.findall(str(health.get("detail", ""))))


async def run(args) -> str:
    names = [instance.name for instance in compile_repository(args.repo).instances]
    server = OmniServer(args.repo, ready_timeout_s=600)
    await server.start()
    outcomes: collections.Counter[str] = collections.Counter()
    faults: list[Fault] = []
    assert server.pid is not None
    server_pid = server.pid
    rss = RssSampler(
        lambda: {
            "server": server_pid,
            **{names[p.instance]: p.pid for p in server.see_stage_processes()},
        }
    )
    try:
        before = Resources.of(server)
        rss.start(args.rss_interval)
        done = asyncio.Event()
        chaos = asyncio.create_task(_chaos(server, names, args, faults, done))
        started = time.monotonic()
        try:
            await asyncio.wait_for(_load(server.url, args, outcomes), args.timeout_s)
        except TimeoutError:  # requests still out were cancelled: reported, not lost
            outcomes["(load) stopped by --timeout-s, requests in flight cancelled"] += 1
        wall = time.monotonic() - started
        done.set()
        await chaos
        await rss.stop()
        after = Resources.of(server)
    finally:
        await server.stop()
    left = server.left
    recovered = [f.recovered_s for f in faults if f.recovered_s is not None]
    nan = float("nan")
    server_errors = sum(n for k, n in outcomes.items() if k.split()[1].startswith("5"))
    lines = [
        f"{sum(outcomes.values())} requests ({', '.join(args.mix)}) at concurrency "
        f"{args.concurrency} in {wall:.0f} s, {len(faults)} faults "
        f"({args.fault_interval:g} s apart, seed {args.seed})",
        "",
        *tables.header(["outcome", "requests"], "lr"),
        *(tables.row([k, v]) for k, v in sorted(outcomes.items())),
        "",
        f"5xx answers: {server_errors} (a request bound to a killed or frozen process fails "
        "with 500 or a cut stream; with --faults 0 any is unexpected)",
        "",
        *tables.header(
            [
                "process",
                "pid",
                "samples",
                "minutes",
                "first MiB",
                "last MiB",
                "MB/min",
                "2nd half MB/min",
            ],
            "lrrrrrrr",
        ),
        *(
            tables.row(
                [
                    series.name,
                    series.pid,
                    len(series.samples),
                    f"{series.span_s / 60:.1f}",
                    f"{series.mib(0):.0f}",
                    f"{series.mib(-1):.0f}",
                    _slope(series.slope_mb_per_min()),
                    _slope(series.late_slope_mb_per_min()),
                ]
            )
            for series in rss.series()
        ),
        "",
        *tables.header(["fault", "victim", "detected in s", "recovered in s"], "llrr"),
        *(tables.row([f.kind, f.victim, _s(f.detected_s), _s(f.recovered_s)]) for f in faults),
        "",
        f"recovery: {len(recovered)}/{len(faults)} faults, median "
        f"{statistics.median(recovered) if recovered else nan:.2f} s, max "
        f"{max(recovered) if recovered else nan:.2f} s",
        "",
        *recovery_by_kind(faults),
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


def _process(instance: str) -> str:
    """An instance's process name: `thinker@r0` -> `thinker` (the kind of stage process)."""
    return instance.split("@", 1)[0]


def recovery_by_kind(faults: list[Fault]) -> list[str]:
    """Recovery per kind of victim process and fault: a SIGKILL is seen at once (the process's
    exit), a SIGSTOP after the heartbeat timeout; what follows is the successor's start."""
    groups: dict[tuple[str, str], list[Fault]] = collections.defaultdict(list)
    for fault in faults:
        groups[(_process(fault.victim), fault.kind)].append(fault)
    lines = tables.header(
        ["process", "fault", "faults", "recovered", "median s", "max s", "median detected s"],
        "llrrrrr",
    )
    for (process, kind), group in sorted(groups.items()):
        times = [f.recovered_s for f in group if f.recovered_s is not None]
        detected = [f.detected_s for f in group if f.detected_s is not None]
        lines.append(
            tables.row(
                [
                    process,
                    kind,
                    len(group),
                    len(times),
                    _s(statistics.median(times) if times else None),
                    _s(max(times) if times else None),
                    _s(statistics.median(detected) if detected else None),
                ]
            )
        )
    return lines


def _slope(mb_per_min: float | None) -> str:
    return "- (under a minute)" if mb_per_min is None else f"{mb_per_min:+.2f}"


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-bench soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path("repository"))
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--faults", type=int, default=10)
    parser.add_argument(
        "--fault-interval",
        type=float,
        default=3.0,
        help="seconds between a recovery and the next fault (aimed at one process, faults "
        "closer than ~12 s apart reach the crash-loop limit: 5 deaths in 60 s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--victims",
        default="",
        help="comma-separated process names the faults hit (e.g. thinker; default: every one)",
    )
    parser.add_argument(
        "--duration-s",
        type=float,
        default=0,
        help="run the load this long instead of --requests requests (0: by count)",
    )
    parser.add_argument(
        "--mix",
        default=",".join(mix.REQUESTS),
        help=f"request kinds, sent in turn ({','.join(mix.REQUESTS)}; the embedded models)",
    )
    parser.add_argument(
        "--rss-interval", type=float, default=5.0, help="seconds between RSS readings"
    )
    parser.add_argument("--timeout-s", type=float, default=3600, help="bound on the whole load")
    parser.add_argument(
        "--recovery-timeout",
        type=float,
        default=120.0,
        help="seconds a fault is waited out before the next one (a victim not back by then "
        "counts as not recovered)",
    )
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.faults < 0 or args.duration_s < 0:
        parser.error("--requests and --concurrency must be >= 1, --faults and --duration-s >= 0")
    args.mix = [k.strip() for k in args.mix.split(",") if k.strip()]
    processes = sorted({_process(i.name) for i in compile_repository(args.repo).instances})
    args.victims = [v.strip() for v in args.victims.split(",") if v.strip()] or processes
    if set(args.victims) - set(processes):
        parser.error(f"--victims: unknown process(es); the repository's: {', '.join(processes)}")
    unknown = [k for k in args.mix if k not in mix.REQUESTS]
    if unknown or not args.mix:
        parser.error(f"--mix: unknown kind(s) {unknown}; kinds: {', '.join(mix.REQUESTS)}")
    if args.rss_interval <= 0:
        parser.error("--rss-interval must be positive")
    args.timeout_s = max(args.timeout_s, args.duration_s + 120)
    print(asyncio.run(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
