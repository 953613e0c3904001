"""omni-bench gpu-tp: the engine's decode speed at TP=1 (one GPU) and TP=2 (two GPUs over NCCL).

    python -m omni_bench.gpu_tp                                # llama-1b and llama-8b, batch 1, 64
    python -m omni_bench.gpu_tp --shapes llama-8b --batches 1,16,64 --steps 64

Random bf16 weights drawn on the GPU (an 8B model in seconds), CUDA graphs on. For each shape
and TP degree one group of processes (one per rank) builds the engine; for each batch size B it
adds B requests of --prompt tokens, prefills them, then times --steps decode steps of
`engine.step()` (the whole step: schedule, graph replay with its all-reduces, sampling on the
host). Rank 0 reports; the table prints ms a step and tokens/s (B / step time), and TP=2's
speed-up over TP=1 in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

from omni_bench.harness.server import free_port
from omni_server.engine import (
    SHAPES,
    Engine,
    EngineConfig,
    GenerationRequest,
    LlamaShape,
    SamplingParams,
    TensorParallel,
)

# Llama-3.1-8B's shape
LLAMA_8B = LlamaShape(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
)
BENCH_SHAPES = {**SHAPES, "llama-8b": LLAMA_8B}
CONTEXT = 256  # max_seq_len: prompt + decoded tokens stay in one context bucket


def _child_main(argv: list[str]) -> int:
    """One rank: build the engine, time the batches, print JSON rows (rank 0)."""
    rank, size, port = int(argv[0]), int(argv[1]), int(argv[2])
    shape_name, batches, steps, prompt = argv[3], argv[4], int(argv[5]), int(argv[6])
    graphs = argv[7] == "1"
    torch.cuda.set_device(rank)
    tp, control = TensorParallel(), None
    if size > 1:
        tp, control = _join_group(rank, size, port)
    sizes = [int(b) for b in batches.split(",")]
    config = EngineConfig(
        max_total_tokens=max(sizes) * CONTEXT + CONTEXT,
        max_batch_size=max(sizes),
        max_step_tokens=4096,
        max_seq_len=CONTEXT,
        dtype="bfloat16",
        device=f"cuda:{rank}",
        cuda_graphs=graphs,
    )
    start = time.perf_counter()
    engine = Engine.from_random(BENCH_SHAPES[shape_name], config, seed=0, tp=tp)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    rows = []
    for b in sizes:
        ms = _decode_ms(engine, b, steps, prompt)
        rows.append(
            {
                "shape": shape_name,
                "tp": size,
                "batch": b,
                "ms_per_step": ms,
                "tok_s": b * 1000.0 / ms,
                "build_s": build_s,
                "weights_gib": sum(p.numel() * p.element_size() for p in engine.model.parameters())
                / 2**30,
            }
        )
    if rank == 0:
        print("ROWS " + json.dumps(rows), flush=True)
    if size > 1:
        import torch.distributed as dist

        dist.barrier(group=control)
        # destroy_process_group can hang once NCCL calls were captured in graphs; leave instead
        sys.stdout.flush()
        os._exit(0)
    return 0


def _join_group(rank: int, size: int, port: int) -> tuple[TensorParallel, Any]:
    """This rank in an NCCL group over the GPUs (the engine's all-reduces), plus a gloo group
    for the final barrier, as a tensor-parallel stage process joins its group."""
    import torch.distributed as dist

    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        device_id=torch.device("cuda", rank),  # NCCL connects now, not inside a graph capture
    )
    control = dist.new_group(backend="gloo")
    return TensorParallel(rank, size, dist.group.WORLD), control


def _decode_ms(engine: Engine, batch: int, steps: int, prompt: int) -> float:
    """Median-free mean ms of one decode step of `batch` requests (after prefill and warm-up)."""
    vocab = engine.shape.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        ids = [(i * 131 + j * 17) % (vocab - 1) + 1 for j in range(prompt)]
        engine.add(GenerationRequest(f"b{batch}-{i}", ids, params))
    running = engine.batcher.running  # the sequences in the batch, in arrival order
    while len(running) < batch or any(s.num_tokens - s.num_computed != 1 for s in running):
        engine.step()  # prefill (chunked by max_step_tokens)
    for _ in range(3):  # the first replay of a bucket captures its graph
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()  # ends in a host sync (the sampled token ids)
    elapsed = time.perf_counter() - start
    for seq in list(running):
        engine.abort(seq.request_id)
    engine.step()  # hands out the abort events
    return elapsed * 1000.0 / steps


def _run_group(shape: str, tp: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    port = free_port()
    child = [sys.executable, "-m", "omni_bench.gpu_tp", "--child"]
    extra = [shape, args.batches, str(args.steps), str(args.prompt), "0" if args.no_graphs else "1"]
    env = {**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
    procs = [
        subprocess.Popen(
            [*child, str(r), str(tp), str(port), *extra], stdout=subprocess.PIPE, env=env, text=True
        )
        for r in range(tp)
    ]
    try:
        outs = [p.communicate(timeout=args.timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    if any(codes):
        raise RuntimeError(f"{shape} at TP={tp}: ranks exited with {codes}")
    line = next(x for x in outs[0].splitlines() if x.startswith("ROWS "))
    rows: list[dict[str, Any]] = json.loads(line[5:])
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return _child_main(argv[1:])
    parser = argparse.ArgumentParser(prog="omni-bench gpu-tp", description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="llama-1b,llama-8b", help=f"of {sorted(BENCH_SHAPES)}")
    parser.add_argument("--tp", default="1,2", help="TP degrees (one GPU per rank)")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps per batch")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--no-graphs", action="store_true", help="eager decode steps")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per group")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("omni-bench gpu-tp: needs CUDA GPUs", file=sys.stderr)
        return 2
    degrees = [int(t) for t in args.tp.split(",")]
    if max(degrees) > torch.cuda.device_count():
        print(f"omni-bench gpu-tp: TP={max(degrees)} needs that many GPUs", file=sys.stderr)
        return 2
    if args.prompt + args.steps + 12 > CONTEXT:
        parser.error(f"--prompt + --steps must stay under {CONTEXT - 12}")
    rows: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        for tp in degrees:
            start = time.perf_counter()
            group_rows = _run_group(shape, tp, args)
            rows += group_rows
            wall = time.perf_counter() - start
            print(f"  {shape} TP={tp} ({wall:.0f} s): {json.dumps(group_rows)}", flush=True)
    base = {(r["shape"], r["batch"]): r["ms_per_step"] for r in rows if r["tp"] == 1}
    graphs = "off" if args.no_graphs else "on"
    print(
        f"\n{torch.cuda.get_device_name(0)}, bf16, CUDA graphs {graphs}, "
        f"{args.prompt}-token prompts, {args.steps} timed decode steps"
    )
    print(
        f"{'shape':<10} {'TP':>3} {'batch':>5} {'ms/step':>8} {'tok/s':>9} {'vs TP=1':>8} "
        f"{'weights GiB/rank':>16} {'build s':>7}"
    )
    for r in rows:
        ref = base.get((r["shape"], r["batch"]))
        speedup = f"{ref / r['ms_per_step']:.2f}x" if ref else "-"
        print(
            f"{r['shape']:<10} {r['tp']:>3} {r['batch']:>5} {r['ms_per_step']:>8.2f} "
            f"{r['tok_s']:>9.0f} {speedup:>8} {r['weights_gib']:>16.1f} {r['build_s']:>7.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
