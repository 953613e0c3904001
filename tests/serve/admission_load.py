"""A measurement, run by hand (not collected by pytest): does admission keep the latency of the
requests it admits when far more arrive than the machine can serve?

    .venv/bin/python -m tests.serve.admission_load [--requests 128] [--concurrency 64]

Starts the embedded repository three times and sends the same short sentence (whole pcm
response) from `--concurrency` clients at once: first at the admission limit itself (the
baseline), then at full concurrency with admission (`--max-in-flight L --max-queued 0`: the
rest get 429), then at full concurrency without it (`--max-in-flight` = concurrency). Prints
one table: requests served and refused, latency of the served ones, time to a 429.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from tests.helpers.server import EMBEDDED_REPO, ServerProcess

TEXT = "The quick brown fox jumps over the lazy dog."


async def load(url: str, requests: int, concurrency: int) -> tuple[list[float], list[float]]:
    """(latencies of 200s, latencies of 429s); any other status is an error."""
    served: list[float] = []
    refused: list[float] = []
    body = {
        "model": "tts-1",
        "voice": "alloy",
        "input": TEXT,
        "response_format": "pcm",
        "stream": False,
    }
    queue = iter(range(requests))

    async def client(session: aiohttp.ClientSession) -> None:
        for _ in queue:
            start = time.perf_counter()
            async with session.post(url + "/v1/audio/speech", json=body) as response:
                await response.read()
                elapsed = time.perf_counter() - start
                if response.status == 200:
                    served.append(elapsed)
                elif response.status == 429:
                    refused.append(elapsed)
                else:
                    raise RuntimeError(f"status {response.status}: {await response.text()}")

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return served, refused


def quantiles(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0] * 1000:.0f} ms"
    q = statistics.quantiles(values, n=10)
    return f"{statistics.median(values) * 1000:.0f} / {q[8] * 1000:.0f} ms"


def run(label: str, flags: list[str], requests: int, concurrency: int) -> str:
    with (
        tempfile.TemporaryDirectory() as tmp,
        ServerProcess.start(EMBEDDED_REPO, Path(tmp) / "server.log", *flags) as server,
    ):
        asyncio.run(load(server.url, 8, 2))  # warm both replicas
        served, refused = asyncio.run(load(server.url, requests, concurrency))
    return (
        f"| {label} | {concurrency} | {len(served)} | {quantiles(served)} | {len(refused)} | "
        f"{quantiles(refused)} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--limit", type=int, default=4, help="places per model (4)")
    args = parser.parse_args()
    c, limit = args.concurrency, args.limit
    rows = [
        run("at the limit (baseline)", ["--max-in-flight", str(limit)], args.requests, limit),
        run(
            f"admission {limit} + no queue",
            ["--max-in-flight", str(limit), "--max-queued", "0"],
            args.requests,
            c,
        ),
        run(
            "no admission limit", ["--max-in-flight", str(c), "--max-queued", "0"], args.requests, c
        ),
    ]
    print("| server | clients | served | served latency p50 / p90 | 429 | 429 after p50 / p90 |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
