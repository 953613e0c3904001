"""`omni-bench ray-serve`: the Ray Serve path against the direct server, and autoscaling.

In one run on this machine: `omni-server` (direct) and `omni-server ray` (one replica behind
Serve's HTTP proxy, a local Ray cluster) serve the same repository; speech TTFA and throughput
are measured on both at each concurrency, levels interleaved (omni_bench.speech.bench), so what
else loads the machine touches both alike. Then `omni-server ray --autoscale 1:2` gets a load
step and the time until a second replica answers is measured (by the `X-Omni-Replica` header of
the responses). Both servers are children started through their command lines and reached over
HTTP only, as a user reaches them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from omni_bench.harness.server import ChildServer, OmniServer
from omni_bench.harness.timing import machine_line
from omni_bench.speech import DEFAULT_DATASET, Level, bench, load_dataset, parse_levels
from omni_bench.targets import OpenAISpeechTarget

SMALL = ("--processes.voice.num_replicas", "1")  # one voice per pipeline: 2 cores here
READY_TIMEOUT_S = 900.0  # a shared 2-core machine can take minutes to load the stages


def _ray_server(repo: Path, args: list[str]) -> ChildServer:
    command = [sys.executable, "-m", "omni_server", "ray", "--repo", str(repo)]
    return ChildServer(
        "omni-server ray",
        lambda port: [*command, "--port", str(port), *args],
        "/health/ready",
        ready_timeout_s=READY_TIMEOUT_S,
    )


def _target(url: str, name: str) -> OpenAISpeechTarget:
    return OpenAISpeechTarget(
        url, model="tts-1", voice="alloy", response_format="pcm", stream=True, name=name
    )


async def compare(repo: Path, texts: list[str], levels: list[int], requests: int) -> list[dict]:
    direct = OmniServer(repo, SMALL, ready_timeout_s=READY_TIMEOUT_S)
    served = _ray_server(repo, [*SMALL, "--num-replicas", "1"])
    async with contextlib.AsyncExitStack() as stack:
        # one after the other, Ray first: a raylet that takes over 30 s to register (a loaded
        # machine) fails Ray's own start
        for server in (served, direct):
            stack.push_async_callback(server.stop)
            await server.start()
        results = await bench(
            [_target(direct.url, "direct"), _target(served.url, "ray-serve")],
            texts,
            [Level(concurrency=c) for c in levels],
            requests,
            warmup=3,
        )
    return [r.as_dict() for r in results]


async def autoscale(repo: Path, text: str, concurrency: int, timeout_s: float) -> dict:
    """Load step from idle to `concurrency` streams on `--autoscale 1:2` with an admission
    limit of 2 (the autoscaler's target per replica): seconds until a second replica answers."""
    server = _ray_server(repo, [*SMALL, "--autoscale", "1:2", "--max-in-flight", "2"])
    await server.start()
    seen: dict[str, float] = {}
    try:
        async with aiohttp.ClientSession() as http:
            start = time.monotonic()
            stop = asyncio.Event()

            async def loop() -> None:
                body = {"model": "tts-1", "voice": "alloy", "input": text, "response_format": "pcm"}
                while not stop.is_set():
                    async with http.post(f"{server.url}/v1/audio/speech", json=body) as r:
                        replica = r.headers.get("X-Omni-Replica", "")
                        await r.read()
                        if r.status == 200 and replica and replica not in seen:
                            seen[replica] = time.monotonic() - start
                    if len(seen) >= 2 or time.monotonic() - start > timeout_s:
                        stop.set()

            await asyncio.gather(*(loop() for _ in range(concurrency)))
    finally:
        await server.stop()
    times = sorted(seen.values())
    return {
        "concurrency": concurrency,
        "second_replica_serving_s": times[1] if len(times) > 1 else None,
        "replicas_seen": len(times),
    }


def _table(targets: list[dict]) -> str:
    lines = ["| target | c | TTFA p50 ms | TTFA p95 ms | req/s | audio s/s | failed |"]
    lines.append("|---|---|---|---|---|---|---|")
    by_level: dict[int, list[tuple[str, dict]]] = {}
    for t in targets:
        for level in t["levels"]:
            by_level.setdefault(level["concurrency"], []).append((t["name"], level))
    for c, rows in sorted(by_level.items()):
        for name, level in rows:
            lines.append(
                f"| {name} | {c} | {level['ttfa']['p50'] * 1000:.1f} | "
                f"{level['ttfa']['p95'] * 1000:.1f} | {level['requests_per_second']:.2f} | "
                f"{level['audio_seconds_per_second']:.1f} | {level['failed']} |"
            )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="omni-bench ray-serve", description=__doc__.split("\n")[0])
    p.add_argument("--repo", type=Path, default=Path("repository"))
    p.add_argument("--concurrency", default="1,4", help="levels, comma separated (1,4)")
    p.add_argument("--requests", type=int, default=24, help="per level and target (24)")
    p.add_argument("--dataset", type=Path, default=DEFAULT_DATASET)
    p.add_argument("--step", type=int, default=6, help="streams of the autoscaling step (6)")
    p.add_argument("--no-autoscale", action="store_true", help="skip the autoscaling step")
    p.add_argument("--out", type=Path, default=Path("bench-results"))
    args = p.parse_args(argv)
    texts = load_dataset(args.dataset)
    print(machine_line(), file=sys.stderr)
    # Ray's session files and the servers' run directories in a directory of this run's own:
    # another Ray on this machine (another user's, another bench's) is never touched
    private = tempfile.mkdtemp(prefix="obr-", dir="/tmp")
    os.environ["TMPDIR"] = private
    try:
        return _run(args, texts)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _run(args: argparse.Namespace, texts: list[str]) -> int:
    targets = asyncio.run(compare(args.repo, texts, parse_levels(args.concurrency), args.requests))
    print(_table(targets))
    result: dict = {"targets": targets}
    if not args.no_autoscale:
        result["autoscale"] = asyncio.run(autoscale(args.repo, max(texts, key=len), args.step, 600))
        print(f"autoscale 1 -> 2: {result['autoscale']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ray_serve.json").write_text(json.dumps(result, indent=2))
    return 0
