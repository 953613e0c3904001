"""omni-bench gpu-moe: Qwen3-Omni's MoE experts on a GPU, plain loop vs the fused Triton kernel.

    python -m omni_bench.gpu_moe [--tokens 1,16,64,256,1024,4096] [--iters 50]

The thinker's full expert shapes (128 experts of hidden 2048, intermediate 768, top-8), random
bf16 weights drawn on the GPU, random routing (softmax over random logits, top 8, renormalised;
the same for both paths). For each token count, the median of --iters timed calls (CUDA events,
after --warmup calls), in µs:

  loop    layers.Experts' plain path on the GPU: one gathered matmul pair per expert hit
  fused   moe_triton.fused_moe: the sort by expert + two grouped-GEMM launches, called eagerly
          (the host's launches included: on a slow host they, not the GPU, set this figure)
  graph   the same call captured once in a CUDA graph, replays timed: the GPU's time alone
  floor   bytes of the experts the routing hits (gate, up, down of each) / 4.8 TB/s (H200 HBM)

With --sweep, also each tile set of SWEEP on the fused kernel, as graphs (the best per row).
Routing (the router's matmul and top-k) is outside both figures: the two paths share it. Imports
are torch's and ours only (runs on a bare GPU machine with torch and triton)."""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from omni_server.models.qwen3_omni.layers import Experts
from omni_server.models.qwen3_omni.moe_triton import Tiles, fused_moe

# (gate_up, down) tile sets tried by --sweep: bm, bn, bk, warps, stages
SWEEP = {
    "a": (Tiles(16, 32, 128, 4, 3), Tiles(16, 64, 128, 4, 3)),
    "b": (Tiles(16, 64, 128, 4, 4), Tiles(16, 128, 128, 4, 4)),
    "c": (Tiles(32, 64, 64, 4, 3), Tiles(32, 64, 64, 4, 3)),
    "d": (Tiles(32, 64, 128, 4, 3), Tiles(32, 128, 64, 4, 4)),
    "e": (Tiles(64, 64, 64, 4, 3), Tiles(64, 128, 64, 8, 3)),
    "f": (Tiles(64, 128, 64, 8, 3), Tiles(64, 128, 64, 8, 4)),
    "g": (Tiles(128, 64, 64, 8, 3), Tiles(128, 128, 64, 8, 3)),
    "h": (Tiles(128, 128, 64, 8, 3), Tiles(128, 128, 64, 8, 3)),
}

HBM_BYTES_PER_S = 4.8e12
THINKER = {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="omni-bench gpu-moe", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="1,16,64,256,1024,4096")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", action="store_true", help="also time each tile set of SWEEP")
    return parser.parse_args(argv)


def thinker_experts(seed: int) -> Experts:
    """Random bf16 experts at the thinker's shapes, drawn on the GPU (1/sqrt(fan_in) scale)."""
    experts = Experts(THINKER["experts"], THINKER["hidden"], THINKER["inter"]).to(
        "cuda", torch.bfloat16
    )
    generator = torch.Generator("cuda").manual_seed(seed)
    with torch.no_grad():
        for weight in (experts.gate_proj, experts.up_proj, experts.down_proj):
            weight.normal_(0, weight.shape[-1] ** -0.5, generator=generator)
    return experts


def median_us(call, warmup: int, iters: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def graph_median_us(call, warmup: int, iters: int) -> float:  # type: ignore[no-untyped-def]
    """`call` captured once in a CUDA graph, each replay timed: the GPU's time alone, without
    the host's launches (what a decode step run as a graph, as the engine runs it, pays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return median_us(graph.replay, warmup, iters)


def measure(experts: Experts, tokens: int, args: argparse.Namespace) -> dict[str, object]:
    generator = torch.Generator("cuda").manual_seed(args.seed + tokens)
    x = torch.randn(tokens, THINKER["hidden"], device="cuda", generator=generator)
    logits = torch.randn(tokens, THINKER["experts"], device="cuda", generator=generator)
    weights, ids = torch.topk(torch.softmax(logits, -1), THINKER["top_k"], dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)
    x = x.to(torch.bfloat16)
    fused = experts.fused
    if fused is None:
        raise SystemExit(
            "omni-bench gpu-moe: the fused kernel was not chosen (is triton installed?)"
        )
    with torch.no_grad():
        experts.fused = None
        loop = median_us(lambda: experts(x, ids, weights), args.warmup, args.iters)
        experts.fused = fused
        kernel = median_us(lambda: experts(x, ids, weights), args.warmup, args.iters)
        graphed = graph_median_us(lambda: experts(x, ids, weights), args.warmup, args.iters)
    best = ("", float("inf"))
    swept: dict[str, float] = {}
    if args.sweep:
        w = (experts.gate_proj, experts.up_proj, experts.down_proj)
        for name, tiles in SWEEP.items():
            with torch.no_grad():
                us = graph_median_us(
                    lambda t=tiles: fused_moe(x, ids, weights, *w, tiles=t), args.warmup, args.iters
                )
            swept[name] = us
            best = min(best, (name, us), key=lambda b: b[1])
    hit = ids.unique().numel()
    expert_bytes = 3 * THINKER["hidden"] * THINKER["inter"] * 2
    return {
        "tokens": tokens,
        "experts_hit": hit,
        "loop_us": loop,
        "fused_us": kernel,
        "graph_us": graphed,
        "floor_us": hit * expert_bytes / HBM_BYTES_PER_S * 1e6,
        "best": f"{best[1]:.1f} ({best[0]})" if best[0] else "",
        "swept": swept,
    }


def table(rows: list[dict[str, object]]) -> str:
    lines = [
        "| tokens | experts hit | loop µs | fused µs | fused graph µs | floor µs | loop / fused "
        "| graph / floor | best swept graph µs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['experts_hit']} | {r['loop_us']:.1f} | {r['fused_us']:.1f} | "
            f"{r['graph_us']:.1f} | {r['floor_us']:.1f} | {r['loop_us'] / r['fused_us']:.1f}x | "
            f"{r['graph_us'] / r['floor_us']:.2f} | {r['best']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("omni-bench gpu-moe: needs a CUDA GPU", file=sys.stderr)
        return 2
    experts = thinker_experts(args.seed)
    rows = [measure(experts, int(t), args) for t in args.tokens.split(",")]
    print(
        f"{torch.cuda.get_device_name(0)}, bf16, thinker experts (128 x SwiGLU 2048 -> 768, "
        f"top-8), median of {args.iters} after {args.warmup} warmup, CUDA events"
    )
    print(table(rows))
    if args.sweep:
        print("\nfused graph µs by tile set (SWEEP: gate_up / down bm-bn-bk-warps-stages)")
        for name, (first, second) in SWEEP.items():
            tiles = "/".join(f"{t.bm}-{t.bn}-{t.bk}-{t.warps}-{t.stages}" for t in (first, second))
            times = " ".join(f"{r['swept'][name]:8.1f}" for r in rows)  # type: ignore[index]
            print(f"{name} {tiles:<32} {times}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
