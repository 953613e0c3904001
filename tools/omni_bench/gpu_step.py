"""omni-bench gpu-step: the engine's decode step on a GPU against its anchors, in one run.

    python -m omni_bench.gpu_step --shapes smollm2-135m,llama-1b,llama-3b --batches 1,64

For each shape (random bf16 weights drawn on the GPU) and batch size b, b requests of
--prompt-tokens tokens decode --new-tokens tokens each (EOS ignored); measured:

  engine      ms per `engine.step()` while all b decode (schedule, graph replay, sampling;
              the median interval between step() returns, so a step launched ahead of its
              tokens counts what it costs in the loop), and tokens/s = b / that; once per
              decode attention (paged kernel, gathered)
  graph       one replay of the engine's captured decode graph for that bucket
  naive       a plain torch step (torch's ops only, none of the engine's fused kernels) with a
              dense static KV cache ([b, Hkv, L, D] per layer, L the context bucket) and SDPA
              over it, captured in one CUDA graph (gpt-fast's shape)
  floor       bytes of weights + KV read per step / 4.8 TB/s (the H200's HBM)
  TTFT        --ttft levels: c requests added at once, mean time to their first token

and the kernel profile of one graph replay of the paged engine (torch.profiler: kernels per step
and time per kernel kind), which says where a step's time goes; with --host-profile, where the
host's part of `engine.step()` goes (cProfile over the steady decode steps, top functions by
own time; the profiler's overhead inflates every figure, so read them as shares).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F

from omni_server.engine import (
    SHAPES,
    Engine,
    EngineConfig,
    GenerationRequest,
    Llama,
    SamplingParams,
    apply_rope,
    bucket_for,
)

HBM_BYTES_PER_S = 4.8e12


def _engine(shape_name: str, batch: int, args: argparse.Namespace, attention: str) -> Engine:
    config = EngineConfig(
        max_total_tokens=max(16384, batch * (args.prompt_tokens + args.new_tokens + 32)),
        max_batch_size=max(batch, 64),
        max_step_tokens=8192,
        max_seq_len=args.prompt_tokens + args.new_tokens + 64,
        dtype="bfloat16",
        device="cuda",
        decode_attention=attention,
    )
    return Engine.from_random(SHAPES[shape_name], config)


def engine_step_ms(engine: Engine, batch: int, args: argparse.Namespace) -> float:
    """Median ms of engine.step() over the decode steps once all `batch` requests decode."""
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    vocab = engine.shape.vocab_size
    for i in range(batch):
        prompt = torch.randint(1, vocab, (args.prompt_tokens,), generator=gen).tolist()
        engine.add(GenerationRequest(f"b{batch}-{i}", prompt, params))
    while any(s.num_computed < s.num_prompt_tokens for s in engine.batcher.running) or (
        engine.num_waiting
    ):
        engine.step()  # prefill (and the first decode graphs' capture)
    # The interval between consecutive step() returns, unsynchronized: a step launched ahead
    # of its tokens (overlap.py) returns while the GPU still computes, so a synchronized
    # window around one call would time the overlap away; a synchronous step's interval is its
    # own time. Counted where a step handed out all b requests' tokens.
    times = []
    torch.cuda.synchronize()
    last = time.perf_counter()
    while engine.has_work():
        events = engine.step()
        now = time.perf_counter()
        if len(events) == batch:
            times.append(now - last)
        last = now
    times = times[3:]  # a new context bucket's graph is captured on its first step
    return sorted(times)[len(times) // 2] * 1e3


def host_profile(engine: Engine, batch: int, args: argparse.Namespace, top: int = 14) -> str:
    """cProfile of 40 steady decode steps of `batch` requests (their graphs already captured):
    the top functions by own time, as pstats prints them."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch + 1)
    for i in range(batch):
        prompt = torch.randint(1, engine.shape.vocab_size, (args.prompt_tokens,), generator=gen)
        engine.add(GenerationRequest(f"p{batch}-{i}", prompt.tolist(), params))
    while any(s.num_computed < s.num_prompt_tokens for s in engine.batcher.running) or (
        engine.num_waiting
    ):
        engine.step()
    for _ in range(4):
        engine.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(40):
        engine.step()
    prof.disable()
    while engine.has_work():
        engine.step()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def replay_ms(graph: torch.cuda.CUDAGraph, n: int = 100) -> float:
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def naive_graph(model: Llama, batch: int, context: int) -> torch.cuda.CUDAGraph:
    """A decode step of `model`'s weights over a dense static cache, captured in one graph."""
    shape, dev = model.local_shape, next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    cache = [
        torch.randn(2, batch, shape.num_kv_heads, context, shape.head_dim, device=dev, dtype=dtype)
        for _ in model.layers
    ]
    ids = torch.randint(1, shape.vocab_size, (batch,), device=dev)
    pos = torch.full((batch,), context - 1, device=dev)
    mask = torch.ones(batch, 1, 1, context, dtype=torch.bool, device=dev)

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # plain torch, unfused
        return weight * F.rms_norm(x.float(), weight.shape, None, 1e-5).to(x.dtype)

    def step() -> torch.Tensor:
        h = model.embed(ids)  # [B, C]
        rope = model.rope[pos].unsqueeze(1)
        for layer, kv in zip(model.layers, cache, strict=True):
            a = layer.attn
            x = norm(h, layer.attn_norm.weight)
            q_size, kv_size, _ = a.split
            qkv = a.wqkv(x)
            qk = apply_rope(qkv[:, : q_size + kv_size].view(batch, -1, a.head_dim), rope)
            q, k = qk[:, : a.num_heads], qk[:, a.num_heads :]
            v = qkv[:, q_size + kv_size :].view(batch, a.num_kv_heads, a.head_dim)
            kv[0].index_copy_(2, pos[:1], k.unsqueeze(2))  # [B, Hkv, 1, D] at one position
            kv[1].index_copy_(2, pos[:1], v.unsqueeze(2))
            o = F.scaled_dot_product_attention(
                q.unsqueeze(2), kv[0], kv[1], attn_mask=mask, enable_gqa=True
            )  # [B, H, 1, D]
            h = h + a.wo(o.reshape(batch, -1))
            gate, up = layer.mlp.w_gate_up(norm(h, layer.ffn_norm.weight)).chunk(2, dim=-1)
            h = h + layer.mlp.w_down(F.silu(gate) * up)
        head = model.embed.weight if model.lm_head is None else model.lm_head.weight
        return F.linear(norm(h, model.norm.weight), head).float()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        step()
    return graph


def kernel_profile(graph: torch.cuda.CUDAGraph, steps: int = 10) -> list[dict[str, Any]]:
    """Kernels of `steps` graph replays by kind: count a step and microseconds a step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = _kind(event.name)
        kinds[name][0] += 1
        kinds[name][1] += event.device_time
    rows = [
        {"kind": k, "per_step": c / steps, "us_per_step": t / steps} for k, (c, t) in kinds.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def _kind(name: str) -> str:
    low = name.lower()
    for key, kind in (
        ("attend", "paged attention (Triton)"),
        ("add_rms", "add + rms_norm (Triton)"),
        ("argmax", "argmax (greedy)"),
        ("merge", "paged attention merge (Triton)"),
        ("gemv", "matmul (gemv)"),
        ("gemm", "matmul (gemm)"),
        ("nvjet", "matmul (nvjet)"),
        ("splitk", "matmul (split-k reduce)"),
        ("rms", "rms_norm"),
        ("softmax", "softmax"),
        ("index", "index / gather / scatter"),
        ("scatter", "index / gather / scatter"),
        ("gather", "index / gather / scatter"),
        ("copy", "copy / cast"),
        ("cat", "copy / cast"),
        ("elementwise", "elementwise"),
        ("reduce", "reduction"),
    ):
        if key in low:
            return kind
    return name[:60]


def run_shape(name: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"shape": name, "rows": []}
    context = args.prompt_tokens + args.new_tokens
    for batch in args.batches:
        row: dict[str, Any] = {"batch": batch}
        for attention in args.attention:
            engine = _engine(name, batch, args, attention)
            row[f"engine_ms_{attention}"] = engine_step_ms(engine, batch, args)
            graphs = engine.runner.graphs
            assert graphs is not None
            bucket = bucket_for(context, graphs.context_buckets)
            g = graphs.graph_for(bucket_for(batch, graphs.batch_buckets), bucket)
            row[f"graph_ms_{attention}"] = replay_ms(g.graph)
            if attention == "paged":
                row["naive_ms"] = replay_ms(naive_graph(engine.model, batch, bucket))
                if args.profile:
                    row["profile"] = kernel_profile(g.graph)
                weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
                kv = batch * context * engine.cache.token_bytes(engine.shape, torch.bfloat16)
                row["floor_ms"] = (weights + kv) / HBM_BYTES_PER_S * 1e3
                row["ttft_ms"] = ttft(engine, args) if batch == max(args.batches) else {}
                if args.host_profile:
                    row["host_profile"] = host_profile(engine, batch, args)
            del engine, graphs, g
            torch.cuda.empty_cache()
        out["rows"].append(row)
        brief = {k: v for k, v in row.items() if k not in ("profile", "host_profile")}
        print(json.dumps(brief), file=sys.stderr)
    return out


def ttft(engine: Engine, args: argparse.Namespace) -> dict[int, float]:
    """Mean ms from adding c requests at once to each one's first token, per level c."""
    result = {}
    gen = torch.Generator().manual_seed(7)
    for c in args.ttft:
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        start = time.perf_counter()
        for i in range(c):
            prompt = torch.randint(1, engine.shape.vocab_size, (args.prompt_tokens,), generator=gen)
            engine.add(GenerationRequest(f"t{c}-{i}", prompt.tolist(), params))
        first: dict[str, float] = {}
        while engine.has_work():
            for e in engine.step():
                first.setdefault(e.request_id, time.perf_counter() - start)
        result[c] = sum(first.values()) / len(first) * 1e3
    return result


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| shape | batch | engine paged ms (tok/s) | engine gathered ms (tok/s) | graph paged / "
        "gathered ms | naive static-cache graph ms (tok/s) | floor ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for r in res["rows"]:
            b = r["batch"]
            gather = r.get("engine_ms_gather")  # absent with --attention paged
            gathered = "-" if gather is None else f"{gather:.2f} ({b / gather * 1e3:,.0f})"
            graph_gather = r.get("graph_ms_gather")
            lines.append(
                f"| {res['shape']} | {b} | {r['engine_ms_paged']:.2f} "
                f"({b / r['engine_ms_paged'] * 1e3:,.0f}) | {gathered} | "
                f"{r['graph_ms_paged']:.2f} / "
                f"{'-' if graph_gather is None else f'{graph_gather:.2f}'} | {r['naive_ms']:.2f} "
                f"({b / r['naive_ms'] * 1e3:,.0f}) | {r['floor_ms']:.3f} |"
            )
    for res in results:
        for r in res["rows"]:
            if r.get("ttft_ms"):
                levels = ", ".join(f"c={c}: {ms:.1f} ms" for c, ms in r["ttft_ms"].items())
                lines.append(f"TTFT {res['shape']}: {levels}")
            for p in r.get("profile", [])[:10]:
                lines.append(
                    f"profile {res['shape']} b={r['batch']}: {p['kind']:<34} "
                    f"{p['per_step']:>6.0f} kernels {p['us_per_step']:>8.1f} us"
                )
            if r.get("host_profile"):
                lines.append(f"host profile {res['shape']} b={r['batch']}:\n{r['host_profile']}")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="omni-bench gpu-step", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="smollm2-135m,llama-1b,llama-3b")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--prompt-tokens", type=int, default=192)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--ttft", default="1,16,64", help="TTFT levels (run at the largest batch)")
    p.add_argument("--profile", action="store_true", help="kernel profile of each graph")
    p.add_argument("--host-profile", action="store_true", help="cProfile of engine.step()")
    p.add_argument("--attention", default="paged,gather", help="decode attentions to run")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.attention = args.attention.split(",")
    if "paged" not in args.attention:
        p.error("--attention must include paged (the anchors are measured beside it)")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.ttft = [int(c) for c in args.ttft.split(",") if c]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("omni-bench gpu-step: needs a CUDA GPU", file=sys.stderr)
        return 2
    results = [run_shape(name, args) for name in args.shapes.split(",")]
    print(f"{torch.cuda.get_device_name(0)}, bf16, CUDA graphs, {args.prompt_tokens}-token "
          f"prompts, {args.new_tokens} new tokens")  # fmt: skip
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
