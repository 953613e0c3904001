"""Quick speech benchmark (issue 5): the served voice against the same voice run in-process.

    python -m omni_bench.speech_quick [--repo repository] [--requests 16] [--levels 1,4,8]

Two questions, one table each:
- time to first audio (TTFA) of a three-sentence paragraph, streamed as raw pcm, at
  concurrency 1, against its floor: the in-process time to the paragraph's first sentence of
  audio (text_frontend, one acoustic call, the encoder) with no HTTP, no processes, no queues;
- requests/s and audio seconds per second at concurrency 1, 4, 8, against the voice run
  in-process by one caller, one request after another. The served pipeline may beat that rate:
  its stages overlap (sentence n is encoded while n+1 is synthesized) and so do requests.

The served TTFA is also split: the server's own histogram (request received to first audio
from the pipeline) against what the client sees, so the HTTP layer's share is visible.

The in-process part runs first and is released before the server starts: both never compete
for the cores. The full load harness with peers and WER is `omni-bench speech`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from omni_bench.inprocess import InProcessVoice

PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog. "
    "A journey of a thousand miles begins with a single step. "
    "Bright stars shine over the quiet harbor tonight."
)
PCM_BYTES_PER_SECOND = 24_000 * 2  # the endpoint's pcm: 24 kHz s16le mono
START_TIMEOUT_S = 180.0


@dataclass
class Timing:
    ttfa: float  # seconds from sending the request to the first audio bytes
    latency: float  # seconds to the last byte
    audio_seconds: float


# ---- the voice in-process ------------------------------------------------------------------


def in_process(repo: Path, runs: int, seed: int) -> tuple[list[float], list[Timing]]:
    """(first-sentence times, whole-request timings) of the voice called directly."""
    voice = InProcessVoice(repo)
    inputs = voice.request(PARAGRAPH, response_format="pcm", stream=True, seed=seed)
    list(voice.stream(inputs))  # warm-up: first onnxruntime calls allocate
    first, whole = [], []
    for _ in range(runs):
        start = time.perf_counter()
        chunks = voice.stream(inputs)
        size = len(next(chunks))
        first.append(time.perf_counter() - start)
        size += sum(len(c) for c in chunks)
        end = time.perf_counter() - start
        whole.append(Timing(first[-1], end, size / PCM_BYTES_PER_SECOND))
    return first, whole


# ---- the served voice ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(repo: Path, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "omni_server", "--repo", str(repo), "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=2):
                return server
        except OSError:
            time.sleep(0.2)
    stop_server(server)
    raise TimeoutError(f"the server was not ready after {START_TIMEOUT_S} s")


def stop_server(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


async def served_request(session: aiohttp.ClientSession, url: str, seed: int) -> Timing:
    body = {
        "model": "tts-1",
        "voice": "alloy",
        "input": PARAGRAPH,
        "response_format": "pcm",
        "stream_format": "audio",
        "seed": seed,
    }
    start = time.perf_counter()
    first, size = None, 0
    async with session.post(url + "/v1/audio/speech", json=body) as response:
        response.raise_for_status()
        async for data in response.content.iter_any():
            if data and first is None:
                first = time.perf_counter() - start
            size += len(data)
    latency = time.perf_counter() - start
    return Timing(first if first is not None else latency, latency, size / PCM_BYTES_PER_SECOND)


async def server_ttfa(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(sum, count) of the server's own TTFA histogram: request received to first audio ready."""
    async with session.get(url + "/metrics") as response:
        text = await response.text()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return (
        values.get("omni_time_to_first_audio_seconds_sum", 0.0),
        values.get("omni_time_to_first_audio_seconds_count", 0.0),
    )


@dataclass
class Level:
    timings: list[Timing]
    wall: float  # seconds for all requests of the level
    server_ttfa: float  # mean TTFA the server measured itself (no client, no HTTP)


async def served_level(url: str, concurrency: int, requests: int, seed: int) -> Level:
    """`requests` requests from `concurrency` clients, after one warm-up request."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await served_request(session, url, seed)
        todo = iter(range(requests))
        timings: list[Timing] = []

        async def client() -> None:
            for _ in todo:
                timings.append(await served_request(session, url, seed))

        sum0, count0 = await server_ttfa(session, url)
        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - start
        sum1, count1 = await server_ttfa(session, url)
        return Level(timings, wall, (sum1 - sum0) / max(count1 - count0, 1))


# ---- report --------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omni_bench.speech_quick",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--repo", type=Path, default=Path("repository"))
    parser.add_argument("--requests", type=int, default=16, help="requests per level (16)")
    parser.add_argument("--levels", default="1,4,8", help="concurrency levels (1,4,8)")
    parser.add_argument("--seed", type=int, default=1, help="request seed: same audio each run")
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]

    first, whole = in_process(args.repo, args.requests, args.seed)
    inproc_wall = sum(t.latency for t in whole)
    inproc_rps = len(whole) / inproc_wall
    inproc_audio = sum(t.audio_seconds for t in whole) / inproc_wall

    port = free_port()
    server = start_server(args.repo, port)
    try:
        results = {
            c: asyncio.run(served_level(f"http://127.0.0.1:{port}", c, args.requests, args.seed))
            for c in levels
        }
    finally:
        stop_server(server)

    audio = whole[0].audio_seconds
    print(
        f"paragraph: 3 sentences, {audio:.1f} s of audio; {args.requests} requests per level; "
        f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at the end\n"
    )
    print("| TTFA, concurrency 1 | p50 | p90 |")
    print("|---|---|---|")
    print(
        f"| in-process, first sentence (floor) | {ms(statistics.median(first))} "
        f"| {ms(p90(first))} |"
    )
    level = results[levels[0]]
    served = [t.ttfa for t in level.timings]
    print(
        f"| served, pcm stream (c={levels[0]}) | {ms(statistics.median(served))} "
        f"| {ms(p90(served))} |\n"
    )
    print(
        f"served TTFA at c={levels[0]}, mean: {ms(statistics.fmean(served))} at the client, "
        f"{ms(level.server_ttfa)} inside the server (request received -> first audio)\n"
    )
    print(
        "| concurrency | served req/s | served audio s/s | TTFA p50 | latency p50 "
        "| in-process req/s (sequential) | served / in-process |"
    )
    print("|---|---|---|---|---|---|---|")
    for c in levels:
        level = results[c]
        rps = len(level.timings) / level.wall
        audio_rate = sum(t.audio_seconds for t in level.timings) / level.wall
        print(
            f"| {c} | {rps:.2f} | {audio_rate:.1f} "
            f"| {ms(statistics.median(t.ttfa for t in level.timings))} "
            f"| {ms(statistics.median(t.latency for t in level.timings))} "
            f"| {inproc_rps:.2f} ({inproc_audio:.1f} audio s/s) | {rps / inproc_rps:.0%} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
