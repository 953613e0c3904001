"""Issue 38's step measures, on the device (a device script: it drives the engine's runner
and batcher directly, below the engine's public surface that omni-bench keeps to):

    python3 tools/device/mixed_step.py --mode mixed --shapes llama-3b --rows 1,16,64 --chunk 256
    python3 tools/device/mixed_step.py --mode mixed --higgs DIR --rows 1,16,64   # a Higgs folder
    python3 tools/device/mixed_step.py --mode prefill-attention --shapes llama-3b \
        --lengths 256,1024,4096

mixed: `rows` requests decode (their graphs captured), then one more request's prompt chunk of
--chunk tokens runs beside them. Timed, each the median of --iters calls of ModelRunner.run
(the engine's forward: inputs built, graph replayed or forward launched; no sampling), wall
clock to a synchronize, and the host's part alone (until run() returns):

  decode      the decode rows alone (their graph)
  chunk       the prompt chunk alone (eager)
  eager mix   the mixed step as before issue 38: every row in one eager forward
  split mix   the mixed step now: the decode graph replayed, the chunk eager beside it
  side stream (--side-stream) the split step with the chunk on a second stream, concurrent
              with the graph where the GPU has room (the bench's code)
  two graphs  (--chunk-graph) the decode graph and the chunk in a graph of its own: what
              capturing first chunks (docs/engine.md) would give; the bench's code, not the
              engine's

prefill-attention: one layer's attention of a prompt chunk of each length (bf16, the shape's
heads), the chunk from position 0 and a chunk of the same length after a prefix as long (the
bottom-right causal case): the old path (K/V broadcast over the query groups for SDPA; a later
chunk's dense [G * n, ctx] mask) against attention.prefill_attention (SDPA with enable_gqa:
flash attention, causal_lower_right for the later chunk). CUDA-event ms, median of --iters.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from omni_server.engine import SHAPES, Engine, EngineConfig, GenerationRequest, SamplingParams
from omni_server.engine.attention import ForwardBatch, PrefillChunk, prefill_attention
from omni_server.engine.batcher import PrefillWork, StepBatch
from omni_server.engine.runner import ModelRunner
from omni_server.engine.sequence import Sequence

TTS_TEXT = (
    "It was the night before my birthday, and the house was quiet except for the clock in the "
    "hall. I lay awake counting the hours, thinking of the morning and of everything it held. "
)


def _engine(args: argparse.Namespace, shape: str | None, rows: int) -> Engine:
    config = EngineConfig(
        max_total_tokens=max(32768, (rows + 1) * (args.prompt_tokens + args.chunk + 512)),
        max_batch_size=max(rows + 1, 8),
        max_step_tokens=max(2048, args.chunk + rows),
        max_seq_len=args.prompt_tokens + args.chunk + 512,
        dtype="bfloat16",
        device="cuda",
        overlap_decode="off",  # every step settled: the rows' ids are real, not PENDING
    )
    if shape is None:
        return Engine.from_checkpoint(args.higgs, config)
    return Engine.from_random(SHAPES[shape], config)


def _prompt(engine: Engine, tokens: int, seed: int, decodes: bool) -> list[int]:
    """A text model: `tokens` random ids. Higgs: a TTS chat prompt (system, scene, text), whole
    for a request that decodes (its frames follow the template's audio start), cut to `tokens`
    for the chunk (it only prefills here)."""
    if engine.tokenizer is None or engine.head.argmax_is_draw:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(1, engine.shape.vocab_size, (tokens,), generator=gen).tolist()
    text = TTS_TEXT * (1 if decodes else 40)
    turns = [
        {"role": role, "content": [{"type": "text", "text": content}]}
        for role, content in (
            ("system", "Generate audio following instruction."),
            ("scene", "Audio is recorded from a quiet room."),
            ("user", text),
        )
    ]
    ids: list[int] = engine.tokenizer.encode_chat(turns)
    if decodes:
        return ids
    assert len(ids) >= tokens, f"the TTS prompt has {len(ids)} tokens, under {tokens}"
    return ids[:tokens]


def _timed(run: Callable[[], object], iters: int) -> tuple[float, float]:
    """(median wall ms to a synchronize, median host ms until `run` returns)."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    wall, host = [], []
    for _ in range(iters):
        start = time.perf_counter()
        run()
        host.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
    return statistics.median(wall) * 1e3, statistics.median(host) * 1e3


def mixed_row(args: argparse.Namespace, shape: str | None, rows: int) -> dict[str, Any]:
    engine = _engine(args, shape, rows)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i in range(rows):
        prompt = _prompt(engine, args.prompt_tokens, i, decodes=True)
        engine.add(GenerationRequest(f"d{i}", prompt, params))
    for _ in range(10_000):  # prefill every row, then a few decode steps (graphs captured)
        engine.step()
        if all(s.num_tokens - s.num_computed == 1 for s in engine.batcher.running):
            break
    for _ in range(4):
        engine.step()
    decodes = list(engine.batcher.running)
    for seq in decodes:  # the block of each row's next position (the batcher's, at schedule)
        engine.batcher.allocator.allocate(seq.block_table, seq.num_tokens)
    engine.add(GenerationRequest("chunk", _prompt(engine, args.chunk, 99, decodes=False), params))
    newcomer: Sequence = engine.batcher.waiting.popleft()
    engine.batcher.admit(newcomer)  # KV blocks for its prompt; it runs only in this bench
    work = PrefillWork(newcomer, 0, args.chunk)
    runner = engine.runner
    row: dict[str, Any] = {"model": shape or "higgs", "rows": rows, "chunk": args.chunk}

    mixed = StepBatch(decodes, [work])
    row["decode"] = _timed(_step(runner, StepBatch(decodes, [])), args.iters)
    row["chunk_alone"] = _timed(_step(runner, StepBatch([], [work])), args.iters)
    row["eager_mix"] = _timed(_step(runner, mixed, split=False), args.iters)
    row["split_mix"] = _timed(_step(runner, mixed), args.iters)
    if args.side_stream:
        row["side_stream"] = _timed(_side_stream(runner, decodes, work), args.iters)
    if args.chunk_graph:
        row["two_graphs"] = _timed(_two_graphs(engine, decodes, work), args.iters)
    runner.split_mixed = True
    del engine, runner, decodes, newcomer, work, mixed  # the next row's engine gets the memory
    gc.collect()
    torch.cuda.empty_cache()
    print(row, file=sys.stderr)
    return row


def _step(runner: ModelRunner, batch: StepBatch, split: bool = True) -> Callable[[], object]:
    def call() -> object:
        runner.split_mixed = split
        return runner.run(batch)

    return call


def _side_stream(
    runner: ModelRunner, decodes: list[Sequence], work: PrefillWork
) -> Callable[[], object]:
    """The split step with the chunk on a second stream, so the GPU may run it while the decode
    graph runs (the halves write disjoint KV slots); the bench's code, not the engine's."""
    graphs = runner.graphs
    assert graphs is not None
    side = torch.cuda.Stream(device=runner.device)

    @torch.inference_mode()  # as ModelRunner.run: the graphs' buffers are inference tensors
    def call() -> object:
        main = torch.cuda.current_stream(runner.device)
        side.wait_stream(main)  # the previous step's writes first
        out = graphs.run(*runner.decode_rows(decodes), decodes)
        with torch.cuda.stream(side):
            chunk_logits = runner.run(StepBatch([], [work]))[0]
        main.wait_stream(side)
        chunk_logits.record_stream(main)  # allocated on `side`, read on `main`
        return torch.cat([out.logits, chunk_logits])

    return call


def _two_graphs(engine: Engine, decodes: list[Sequence], work: PrefillWork) -> Callable[[], object]:
    """The next step's bound, not the engine's code: the mixed step with the chunk captured too
    (a first chunk of text rows, its length a bucket of its own), so the step is two replays:
    the decode rows' graph (as the split step) and this chunk's graph."""
    runner, cache, dev = engine.runner, engine.cache, engine.runner.device
    graphs = runner.graphs
    assert graphs is not None and work.start == 0
    n = work.length
    slots = cache.slot_matrix([work.seq.block_table], n)[0].to(dev)
    inputs = engine.head.step_inputs(StepBatch([], [work]), dev)
    assert inputs is None, "a chunk with frame rows has no static inputs here"
    static = ForwardBatch(
        input_ids=torch.tensor(work.seq.token_ids[:n], device=dev),
        positions=torch.arange(n, device=dev),
        slot_mapping=slots,
        logits_indices=torch.tensor([n - 1], device=dev),
        decode=None,
        prefills=[PrefillChunk(0, n, slots)],
    )
    stream = torch.cuda.Stream(device=dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(2):  # warm-up outside the capture
            runner.model.forward(static, cache.k, cache.v)
    torch.cuda.current_stream(dev).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream), torch.inference_mode():
        chunk_logits = runner.model.forward(static, cache.k, cache.v)

    @torch.inference_mode()  # as ModelRunner.run: the graphs' buffers are inference tensors
    def call() -> object:
        out = graphs.run(*runner.decode_rows(decodes), decodes)
        graph.replay()
        return torch.cat([out.logits, chunk_logits])

    return call


def mixed_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| model | decode rows | decode-only ms | chunk alone ms | eager mixed ms (host) | "
        "split mixed ms (host) | split / eager | split, chunk on a side stream ms (host) | "
        "two graphs ms (host) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        eager, split = r["eager_mix"], r["split_mix"]
        graphs, side = (
            "-" if r.get(key) is None else f"{r[key][0]:.2f} ({r[key][1]:.2f})"
            for key in ("two_graphs", "side_stream")  # --chunk-graph, --side-stream
        )
        lines.append(
            f"| {r['model']} | {r['rows']} | {r['decode'][0]:.2f} | {r['chunk_alone'][0]:.2f} | "
            f"{eager[0]:.2f} ({eager[1]:.2f}) | {split[0]:.2f} ({split[1]:.2f}) | "
            f"{split[0] / eager[0]:.2f} | {side} | {graphs} |"
        )
    return "\n".join(lines)


def broadcast_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """attention.py's prefill before issue 38 (kept here as the measured baseline): the G query
    heads of a KV head as G * n rows; the first chunk with K/V broadcast over the groups and
    is_causal, a later chunk with its dense [n, ctx] mask repeated G times."""
    n, heads, dim = q.shape
    ctx, kv_heads = k.shape[0], k.shape[1]
    group = heads // kv_heads
    qp = q.view(n, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * n, dim)
    kp, vp = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, ctx, D]
    if ctx == n:
        q4 = qp.view(kv_heads, group, n, dim)
        o = F.scaled_dot_product_attention(q4, kp.unsqueeze(1), vp.unsqueeze(1), is_causal=True)
    else:  # the runner built this mask per chunk (causal_chunk_mask)
        q_pos = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= q_pos
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask.repeat(group, 1))
    return o.reshape(kv_heads, group, n, dim).permute(2, 0, 1, 3).reshape(n, heads, dim)


def _event_ms(run: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def attention_rows(args: argparse.Namespace, shape_name: str) -> list[dict[str, Any]]:
    shape = SHAPES[shape_name]
    heads, kv_heads, dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for n in args.lengths:
        for prefix in (0, n):
            q = torch.randn(n, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
            k, v = (
                torch.randn(prefix + n, kv_heads, dim, device="cuda", dtype=torch.bfloat16,
                            generator=gen)
                for _ in range(2)
            )  # fmt: skip
            new = prefill_attention(q, k, v)
            error = (new.float() - broadcast_prefill(q, k, v).float()).abs().max().item()
            row = {
                "shape": shape_name,
                "tokens": n,
                "prefix": prefix,
                "old_ms": _event_ms(partial(broadcast_prefill, q, k, v), args.iters),
                "new_ms": _event_ms(partial(prefill_attention, q, k, v), args.iters),
                "max_abs_diff": error,
            }
            print(row, file=sys.stderr)
            out.append(row)
    return out


def attention_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| shape | chunk tokens | after a prefix of | broadcast / masked SDPA ms | "
        "prefill_attention ms | speedup | max abs diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['prefix']} | {r['old_ms']:.3f} | "
            f"{r['new_ms']:.3f} | {r['old_ms'] / r['new_ms']:.1f}x | {r['max_abs_diff']:.1e} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> tuple[str, Any]:
    """The mode's table and its results (main prints / writes them)."""
    shapes = [s for s in args.shapes.split(",") if s]
    if args.mode == "prefill-attention":
        rows = [r for name in shapes for r in attention_rows(args, name)]
        return attention_table(rows), rows
    models: list[str | None] = [None] if args.higgs else list(shapes)
    results = [mixed_row(args, model, rows) for model in models for rows in args.rows]
    return mixed_table(results), results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("mixed", "prefill-attention"), default="mixed")
    p.add_argument("--shapes", default="llama-3b", help="engine shapes (omni_server.engine.SHAPES)")
    p.add_argument("--prompt-tokens", type=int, default=192, help="mixed: the decode rows' prompts")
    p.add_argument("--json", default=None, help="write the results here too")
    p.add_argument("--rows", default="1,16,64", help="mixed: decode rows beside the chunk")
    p.add_argument("--chunk", type=int, default=256, help="mixed: the prompt chunk's tokens")
    p.add_argument("--higgs", type=Path, default=None, help="mixed: a Higgs checkpoint folder")
    p.add_argument("--lengths", default="256,1024,4096", help="prefill-attention: chunk tokens")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument(
        "--side-stream",
        action="store_true",
        help="mixed: also the split step with the chunk on a second stream (GPU concurrency)",
    )
    p.add_argument(
        "--chunk-graph",
        action="store_true",
        help="mixed: also the step with the chunk captured in a graph of its own (the bound of "
        "graphing first chunks; the chunk must be text rows)",
    )


def finish(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Parse the lists; a bad value ends the run with one line (exit 2)."""
    for name in ("rows", "lengths"):
        text = getattr(args, name)
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            p.error(f"--{name}: expected integers separated by commas, got {text!r}")
        if any(v < 1 for v in values):
            p.error(f"--{name}: every value must be at least 1, got {text!r}")
        setattr(args, name, values)
    if args.higgs is not None and not (args.higgs / "config.json").is_file():
        p.error(f"--higgs {args.higgs}: no config.json (write one: omni-bench random-checkpoint)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    finish(p, args)
    if not torch.cuda.is_available():
        print("mixed_step.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    text, rows = run(args)
    print(f"{torch.cuda.get_device_name(0)}, bf16, --mode {args.mode}")
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": {**vars(args), "higgs": str(args.higgs)}, "results": rows}, f,
                      indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
