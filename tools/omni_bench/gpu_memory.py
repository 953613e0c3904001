"""omni-bench gpu-memory: the engine's KV cache sized from a GPU memory fraction, and what the
allocator really reached under that fraction.

    python -m omni_bench.gpu_memory                        # smollm2-135m, llama-1b at 0.1, 0.3
    python -m omni_bench.gpu_memory --shapes llama-1b --fractions 0.05 --prompt 3000

Random bf16 weights on cuda:0, CUDA graphs on. Each (shape, fraction) runs in a fresh process
that does what a stage process does: caps its allocator at the fraction
(`torch.cuda.set_per_process_memory_fraction`), then builds the engine, which sizes its KV cache
as total x fraction - weights - workspace - margin (engine/memory.py, engine/workspace.py). Then
the load: every decode graph captured (`--capture-all`), and `--max-batch` requests of about
`--prompt` tokens each (prefilled in max_step_tokens chunks beside running decodes) decoding
`--new` tokens together. The table prints every term of the sizing and the allocator's peaks
against the budget: the sizing is honest when the load ran (no out-of-memory under the cap).
Peak allocated is what the engine really held; reserved may approach the cap, since the caching
allocator keeps freed blocks until an allocation needs them back.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

from omni_bench.harness import tables

GiB = float(1 << 30)


def _child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from omni_server.engine import (
        SHAPES,
        Engine,
        EngineConfig,
        GenerationRequest,
        MemoryBudgetError,
        SamplingParams,
    )

    fraction = float(args.fractions)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)  # as a stage process does
    config = EngineConfig(
        device="cuda:0",
        dtype="bfloat16",
        gpu_memory_fraction=fraction,
        max_batch_size=args.max_batch,
        max_step_tokens=args.max_step,
        max_seq_len=args.max_seq_len,
    )
    row: dict[str, Any] = {"shape": args.shapes, "fraction": fraction}
    start = time.perf_counter()
    try:
        engine = Engine.from_random(SHAPES[args.shapes], config)
    except MemoryBudgetError as err:
        return {**row, "error": str(err)}
    row["build_s"] = time.perf_counter() - start
    sizing = engine.memory
    assert sizing is not None
    row.update(
        total=sizing.total,
        budget=sizing.budget,
        weights=sizing.resident,
        workspace=sizing.workspace,
        margin=sizing.margin + sizing.rounding,
        kv_bytes=engine.cache.nbytes,
        kv_tokens=engine.cache.capacity_tokens,
    )
    start = time.perf_counter()
    engine.warmup(capture_all_graphs=args.capture_all)
    row["warmup_s"] = time.perf_counter() - start
    prompt = min(args.prompt, args.max_seq_len - args.new - args.max_batch)
    requests = [
        GenerationRequest(
            f"r{i}",
            [(7 * i + j) % 1000 + 1 for j in range(prompt + i)],
            SamplingParams(
                temperature=1.0, top_p=0.9, seed=i, max_tokens=args.new, ignore_eos=True
            ),
        )
        for i in range(args.max_batch)
    ]
    start = time.perf_counter()
    try:
        engine.generate(requests)
        row["load"] = "ok"
    except torch.OutOfMemoryError as err:
        row["load"] = "OOM: " + str(err).split(".")[1].strip()
    row["load_s"] = time.perf_counter() - start
    row["peak_reserved"] = torch.cuda.max_memory_reserved(0)
    row["peak_allocated"] = torch.cuda.max_memory_allocated(0)
    return row


def _run(args: argparse.Namespace, shape: str, fraction: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "omni_bench.gpu_memory", "--child"]
    argv += ["--shapes", shape, "--fractions", fraction]
    for name in ("max_batch", "max_step", "max_seq_len", "prompt", "new"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.capture_all:
        argv.append("--capture-all")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        return {"shape": shape, "fraction": float(fraction), "error": done.stderr[-400:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


COLUMNS = [
    "shape", "fraction", "budget GiB", "weights GiB", "workspace GiB", "margin GiB", "KV GiB",
    "KV tokens", "peak allocated GiB", "peak reserved GiB", "allocated / budget", "load",
    "build s", "warm-up s",
]  # fmt: skip
SIZES_GIB = ("budget", "weights", "workspace", "margin", "kv_bytes")


def _table(rows: list[dict[str, Any]]) -> str:
    lines = tables.header(COLUMNS)
    for r in rows:
        if "error" in r:
            lines.append(tables.row([r["shape"], f"{r['fraction']:g}", r["error"]]))
            continue
        sizes = [f"{r[k] / GiB:.2f}" for k in SIZES_GIB]
        peaks = [f"{r['peak_allocated'] / GiB:.2f}", f"{r['peak_reserved'] / GiB:.2f}"]
        used = f"{r['peak_allocated'] / r['budget']:.3f}"
        times = [f"{r['build_s']:.1f}", f"{r['warmup_s']:.1f}"]
        cells = [r["shape"], f"{r['fraction']:g}", *sizes, r["kv_tokens"], *peaks, used]
        lines.append(tables.row([*cells, r["load"], *times]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-bench gpu-memory", description=__doc__)
    parser.add_argument("--shapes", default="smollm2-135m,llama-1b")
    parser.add_argument("--fractions", default="0.1,0.3")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--max-step", type=int, default=4096)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=3000, help="prompt tokens per request")
    parser.add_argument("--new", type=int, default=32, help="tokens decoded per request")
    parser.add_argument("--capture-all", action="store_true", help="capture every decode graph")
    parser.add_argument("--timeout", type=float, default=300.0, help="per configuration, s")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args)))
        return 0
    rows = [
        _run(args, shape, fraction)
        for shape in args.shapes.split(",")
        for fraction in args.fractions.split(",")
    ]
    print(
        f"max_batch_size {args.max_batch}, max_step_tokens {args.max_step}, max_seq_len "
        f"{args.max_seq_len}, bf16, CUDA graphs ({'all captured' if args.capture_all else 'lazy'}"
        f"); load: {args.max_batch} requests x ~{args.prompt} prompt + {args.new} new tokens"
    )
    print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
