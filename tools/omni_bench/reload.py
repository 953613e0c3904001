"""omni-bench reload: what a model reload costs on the embedded repository.

    omni-bench reload                          # the voice (piper-joe), then the thinker
    omni-bench reload --models piper-joe --rounds 5

For each model: copies the embedded repository to a temporary folder, starts omni-server with
`--model-control-mode explicit --load-model MODEL` (so the model's group runs alone), then each
round edits the group's stage code (a comment appended to its model.py: the fingerprint changes,
the plan does not) and calls `POST /v2/repository/models/MODEL/load`. Measured per round:
the time from the call to its answer (the new version serving: every new process ready, traffic
moved; and, as a call answers after its clean-up, the old version stopped), the stage processes'
resident memory before the call and at its peak while both versions run (sampled every 50 ms
from /proc), and the time until the old version's processes are gone (the drain; no request is
in flight here, so it is the stop itself). Prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from omni_bench.harness.server import OmniServer, stage_processes
from omni_bench.harness.tables import table

REPOSITORY = Path(os.environ.get("OMNI_REPOSITORY", "repository"))
GROUP_STAGES = {"piper-joe": ["acoustic"], "smol-chat": ["thinker"]}  # a stage file to edit
SAMPLE_S = 0.05


def _rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue  # exited while we looked
    return total / 1024


async def _round(server: OmniServer, repo: Path, model: str, n: int) -> dict[str, float]:
    assert server.pid is not None
    for stage in GROUP_STAGES[model]:
        with (repo / stage / "model.py").open("a") as f:
            f.write(f"\n# reload round {n}\n")
    old = [p.pid for p in stage_processes(server.pid)]
    before = _rss_mib(old)
    peak = before
    url = f"{server.url}/v2/repository/models/{model}/load"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        started = time.monotonic()
        call = asyncio.ensure_future(session.post(url, json={}))
        while not call.done():
            peak = max(peak, _rss_mib([p.pid for p in stage_processes(server.pid)]))
            await asyncio.sleep(SAMPLE_S)
        response = await call
        serving_s = time.monotonic() - started
        if response.status != 200:  # the memory of the attempt still counts
            print(f"load {model}: {response.status} {await response.text()}", flush=True)
            return {
                "serving_s": float("nan"),
                "drained_s": float("nan"),
                "before": before,
                "peak": peak,
            }
        while any(Path(f"/proc/{pid}").exists() for pid in old):
            peak = max(peak, _rss_mib([p.pid for p in stage_processes(server.pid)]))
            await asyncio.sleep(SAMPLE_S)
        drained_s = time.monotonic() - started
    return {"serving_s": serving_s, "drained_s": drained_s, "before": before, "peak": peak}


async def _measure(model: str, rounds: int) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory(prefix="omni-bench-reload-") as tmp:
        repo = Path(tmp) / "repository"
        shutil.copytree(REPOSITORY, repo, ignore=shutil.ignore_patterns("__pycache__"))
        args = ["--model-control-mode", "explicit", "--load-model", model]
        server = OmniServer(repo, args, ready_timeout_s=600)
        await server.start()
        try:
            return [await _round(server, repo, model, n) for n in range(rounds)]
        finally:
            await server.stop(check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-bench reload", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="piper-joe,smol-chat", help="(piper-joe,smol-chat)")
    parser.add_argument("--rounds", type=int, default=3, help="reloads per model (3)")
    args = parser.parse_args(argv)
    rows = []
    for model in [m for m in args.models.split(",") if m]:
        if model not in GROUP_STAGES:
            parser.error(f"--models: one of {', '.join(GROUP_STAGES)}; got {model!r}")
        try:
            results = asyncio.run(_measure(model, args.rounds))
        except RuntimeError as exc:  # a load that failed (say, past the start timeout): a row
            print(f"{model}: {exc}")
            rows.append([model, "failed", "", "", "", ""])
            continue
        for key in ("serving_s", "drained_s", "before", "peak"):
            values = [r[key] for r in results]
            print(f"{model} {key}: {', '.join(f'{v:.2f}' for v in values)}", flush=True)
        rows.append(
            [
                model,
                f"{statistics.median(r['serving_s'] for r in results):.2f}",
                f"{max(r['serving_s'] for r in results):.2f}",
                f"{statistics.median(r['drained_s'] for r in results):.2f}",
                f"{statistics.median(r['before'] for r in results):.0f}",
                f"{statistics.median(r['peak'] - r['before'] for r in results):.0f}",
            ]
        )
    headers = [
        "model",
        "load->serving p50 s",
        "max s",
        "old gone p50 s",
        "RSS before MiB",
        "extra RSS both MiB",
    ]
    print(table(headers, rows))
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    return 0 if all(r[1] != "failed" for r in rows) else 1
