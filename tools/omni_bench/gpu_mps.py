"""Two GPU stage processes on one GPU under load, MPS off against on (a GPU machine).

    omni-bench gpu-mps [--requests 200] [--concurrency 4] [--size 8192] [--rows 16]
                       [--layers 64] [--fraction 0.3] [--gpu 0]

Two stages, `s0` and `s1`, each in its own process on `cuda:GPU` with `--fraction` of its
memory, each the terminal of a model of its own. A request is a decode-like step loop: `--rows`
rows through `--layers` matmuls with a `--size` square bf16 weight (x = tanh(x @ W)), then a
sync: small-M GEMMs that read the whole weight and leave SMs idle, the work MPS can overlap.
Load: `--concurrency` clients per model, `--requests` per model, after a warm-up. Rows:
- one process alone (the other idle): what one process gets from the GPU;
- two processes, MPS off: the GPU time-slices between their contexts;
- two processes, MPS on: one MPS server, kernels of both may run at once.
Columns: aggregate requests/s, p50 / p95 request latency, and each process's peak
`torch.cuda.max_memory_allocated` against its budget (fraction x total memory).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from omni_bench.harness import tables
from omni_bench.harness.timing import closed_loop, percentile
from omni_server.backend import Request, StageBackend, StageContext
from omni_server.compiler import Plan, compile_repository
from omni_server.gpu import discover
from omni_server.pipeline import PipelineError, Runtime

_STAGE_FILE = """
from omni_bench.gpu_mps import MatmulLoad  # noqa: F401
"""


class MatmulLoad(StageBackend):
    """One decode-like step loop per request, on this stage's GPU."""

    def initialize(self, context: StageContext) -> None:
        import torch

        p = context.parameters
        self.device = torch.device(context.device)
        self.rows, self.layers = int(p["rows"]), int(p["layers"])
        gen = torch.Generator(device=self.device).manual_seed(0)
        size = int(p["size"])
        self.weight = torch.randn(
            size, size, device=self.device, dtype=torch.bfloat16, generator=gen
        ) / (size**0.5)  # [K, N]: the "model" read once per layer
        self.x0 = torch.randn(self.rows, size, device=self.device, dtype=torch.bfloat16)
        self.on_gpu = self.device.type == "cuda"  # else the --cpu smoke run
        total = torch.cuda.get_device_properties(self.device).total_memory if self.on_gpu else 0
        self.budget = (context.gpu_memory_fraction or 0.0) * total
        self.step(self.x0)  # kernels chosen, memory pooled before the first request

    def step(self, x: Any) -> float:
        import torch

        for _ in range(self.layers):
            x = torch.tanh(x @ self.weight)  # [rows, size]
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        return float(x[0, 0])

    def execute(self, requests: list[Request]) -> list[dict[str, Any]]:
        import os

        import torch

        out = []
        for _ in requests:
            value = self.step(self.x0)
            out.append(
                {
                    "value": value,
                    "peak": torch.cuda.max_memory_allocated(self.device) if self.on_gpu else 0,
                    "budget": self.budget,
                    "pid": os.getpid(),
                    "mps": os.environ.get("CUDA_MPS_PIPE_DIRECTORY") is not None,
                }
            )
        return out


def _plan(root: Path, args: argparse.Namespace, mps: str) -> Plan:
    for name in ("s0", "s1"):
        folder = root / name
        folder.mkdir(parents=True)
        (folder / "model.py").write_text(_STAGE_FILE)
        (folder / "stage.toml").write_text(
            'backend = "model.py:MatmulLoad"\nterminal = true\n'
            + ("" if args.cpu else f"gpu = {args.gpu}\ngpu_memory_fraction = {args.fraction}\n")
            + f"[parameters]\nsize = {args.size}\nrows = {args.rows}\nlayers = {args.layers}\n"
        )
    models = "".join(f'[models.m{i}]\nentry = "s{i}"\ntasks = ["speech"]\n' for i in (0, 1))
    (root / "repository.toml").write_text(f'[server]\nmps = "{mps}"\n' + models)
    return compile_repository(root)


async def _load(
    runtime: Runtime, models: list[str], requests: int, concurrency: int
) -> tuple[float, list[float], list[dict[str, Any]]]:
    """(wall seconds, latencies, outputs) of `requests` per model at `concurrency` per model."""
    latencies: list[float] = []
    outputs: list[dict[str, Any]] = []

    def client(model_id: str) -> Callable[[int], Awaitable[None]]:
        model = runtime.plan.models[model_id]

        async def one(_: int) -> None:
            start = time.perf_counter()
            outputs.append(await runtime.submit(model, {}).result())
            latencies.append(time.perf_counter() - start)

        return one

    start = time.perf_counter()  # the models' loads run at once: one wall clock for both
    await asyncio.gather(*(closed_loop(range(requests), concurrency, client(m)) for m in models))
    return time.perf_counter() - start, latencies, outputs


async def _row(args: argparse.Namespace, mps: str, models: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="omni-bench-mps-") as tmp:
        plan = _plan(Path(tmp), args, mps)
        runtime = Runtime(plan)
        await runtime.start()
        try:
            await _load(runtime, models, args.warmup, args.concurrency)
            wall, latencies, outputs = await _load(runtime, models, args.requests, args.concurrency)
        finally:
            await runtime.stop()
    peaks: dict[int, tuple[int, float, bool]] = {}  # pid -> (peak bytes, budget, under MPS)
    for o in outputs:
        before = peaks[o["pid"]][0] if o["pid"] in peaks else 0
        peaks[o["pid"]] = (max(o["peak"], before), o["budget"], o["mps"])
    return {
        "rps": len(latencies) / wall,
        "p50": percentile(latencies, 50) * 1e3,
        "p95": percentile(latencies, 95) * 1e3,
        "peaks": sorted(peaks.values(), key=lambda p: -p[0]),
        "under_mps": all(m for _, _, m in peaks.values()),
    }


async def run(args: argparse.Namespace) -> None:
    rows = [
        ("one process alone", "off", ["m0"]),
        ("two processes, MPS off", "off", ["m0", "m1"]),
        ("two processes, MPS on", "on", ["m0", "m1"]),
    ]
    where = "cpu (a smoke run)" if args.cpu else f"cuda:{args.gpu}"
    print(
        f"# gpu-mps: {where}, {args.rows} rows x {args.layers} layers of a "
        f"{args.size}^2 bf16 weight per request; {args.requests} requests per model, "
        f"{args.concurrency} clients per model; fraction {args.fraction} per process"
    )
    columns = [
        f"{'setup':<24}",
        "req/s",
        "p50 ms",
        "p95 ms",
        f"{'peak / budget per process (GiB)':<31}",
    ]
    print("\n".join(tables.header([*columns, "MPS"], "lrrrll")))
    for label, mps, models in rows:
        try:
            r = await _row(args, mps, models)
        except PipelineError as exc:  # e.g. mps = on where MPS cannot start
            print(tables.row([f"{label:<24}", f"failed to start: {exc}"]), flush=True)
            continue
        peaks = ", ".join(f"{p / 2**30:.2f} / {b / 2**30:.1f}" for p, b, _ in r["peaks"])
        times = [f"{r['rps']:5.0f}", f"{r['p50']:6.2f}", f"{r['p95']:6.2f}"]
        mps_used = f"{'yes' if r['under_mps'] else 'no':<3}"
        print(tables.row([f"{label:<24}", *times, f"{peaks:<31}", mps_used]), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-bench gpu-mps", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="per model (200)")
    parser.add_argument("--warmup", type=int, default=20, help="per model, not measured (20)")
    parser.add_argument("--concurrency", type=int, default=4, help="clients per model (4)")
    parser.add_argument("--size", type=int, default=8192, help="square weight's side (8192)")
    parser.add_argument("--rows", type=int, default=16, help="rows per matmul (16)")
    parser.add_argument("--layers", type=int, default=64, help="matmuls per request (64)")
    parser.add_argument("--fraction", type=float, default=0.3, help="memory per process (0.3)")
    parser.add_argument("--gpu", type=int, default=0, help="the GPU (0)")
    parser.add_argument(
        "--cpu", action="store_true", help="stages on the CPU: a smoke run of the tool, no GPU"
    )
    args = parser.parse_args(argv)
    machine = discover(os.environ)  # as the runtime does: no CUDA context in this process
    if not args.cpu and machine.gpu(args.gpu) is None:
        print(f"omni-bench gpu-mps: needs cuda:{args.gpu} ({machine.why_no_gpu})", file=sys.stderr)
        return 2
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
