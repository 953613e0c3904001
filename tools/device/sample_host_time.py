"""Host time of one step's sampling (the head's `sample`) at batch 1 / 16 / 64, text and frames.

    python3 tools/device/sample_host_time.py [--device cpu|cuda] [--batches 1,16,64] [--calls 200]

Runs the engine's own head over its own running requests (each batch's requests prefilled, so
every row is a decode row with its per-request state), on fixed logits, with the served
settings: text greedy and seeded (temperature 1, top-k 50, top-p 0.9), frames greedy, seeded
and seeded with repetition-aware sampling (7 / 2). Prints the median microseconds a call.

On the CPU with small logits (a 512-token text vocabulary; Higgs' tiny checkpoint, 8 x 1026
codes) the sampler's arithmetic is a few microseconds, so the time is the host's: Python over
rows, tensors built from lists, per-row generators, syncs. On a GPU (`--device cuda`) it is the
host's time to build and launch the work plus the one read back; `--sync` adds a device
synchronize after each call (the sampler's GPU time included); `--graphs` draws from CUDA
graphs as an engine with decode graphs does (draw_graphs.py; a checkout without them fails).

`--steps SHAPE` (e.g. smollm2-135m, random weights) times whole decode steps instead: the median
`Engine.step()` of a batch of decoding requests, greedy against seeded sampling, with the
engine's defaults on the device (CUDA graphs and steps in flight where they apply): what a
sampled row costs a step beside a greedy one.

The same script runs against any checkout (the head API it calls is the engine's seam,
head.py), which is how the before / after table in docs/engine.md was made.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from omni_server.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from omni_server.engine.config import LlamaShape

TEXT_SHAPE = LlamaShape(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
    num_kv_heads=1, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-5,
    max_position_embeddings=256,
)  # fmt: skip


def _running(engine: Engine, batch: int, params: SamplingParams, prompt: list[int]) -> list[Any]:
    for i in range(batch):
        engine.add(GenerationRequest(f"r{i}", list(prompt), params))
    while engine.num_waiting or any(
        s.num_computed < s.num_tokens - 1 for s in engine.batcher.running
    ):
        engine.step()
    return list(engine.batcher.running)


def _time(engine: Engine, seqs: list[Any], logits: torch.Tensor, calls: int, sync: bool) -> float:
    head = engine.head
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        head.sample(logits, seqs, None)
        if sync and logits.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(
    kind: str, engine: Engine, prompt: list[int], batches: list[int], calls: int, sync: bool
) -> list[tuple[str, int, float]]:
    settings = {
        "greedy": SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
        "seeded": SamplingParams(
            temperature=1.0, top_k=50, top_p=0.9, seed=1, max_tokens=200, ignore_eos=True
        ),
    }
    if kind == "frames":
        settings["seeded+ras"] = SamplingParams(
            temperature=1.0, top_k=50, top_p=0.9, seed=1, max_tokens=200, ignore_eos=True,
            ras_window=7, ras_max_repeat=2,
        )  # fmt: skip
    device = next(engine.model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, params in settings.items():
        for b in batches:
            seqs = _running(engine, b, params, prompt)
            width = engine.shape.vocab_size if kind == "text" else _frame_width(engine)
            logits = torch.randn(b, width, generator=gen).to(device)
            rows.append((f"{kind} {name}", b, _time(engine, seqs, logits, calls, sync)))
            for seq in seqs:
                engine.abort(seq.request_id)
            engine.step()
    return rows


def steps(shape: str, device: str, batches: list[int], calls: int) -> list[tuple[str, int, float]]:
    """Median ms of Engine.step() over `calls` decode steps, greedy and seeded, per batch."""
    from omni_server.engine.config import SHAPES

    config = EngineConfig.from_table(
        {"device": device, "dtype": "bfloat16" if device == "cuda" else "float32",
         "max_total_tokens": 65536, "max_batch_size": max(batches)}
    )  # fmt: skip
    engine = Engine.from_random(SHAPES[shape], config)
    engine.warmup()
    gen = torch.Generator().manual_seed(0)
    settings = {
        "greedy": SamplingParams(temperature=0, max_tokens=calls + 40, ignore_eos=True),
        "seeded": SamplingParams(
            temperature=1.0, top_k=50, top_p=0.9, seed=1, max_tokens=calls + 40, ignore_eos=True
        ),
    }
    rows = []
    for name, params in settings.items():
        for b in batches:
            prompt = torch.randint(1, 1000, (64,), generator=gen).tolist()
            seqs = _running(engine, b, params, prompt)
            for _ in range(5):
                engine.step()
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
            rows.append((f"{shape} step {name}", b, statistics.median(times) * 1e3))
            for seq in seqs:
                engine.abort(seq.request_id)
            while engine.has_work():
                engine.step()
    return rows


def _frame_width(engine: Engine) -> int:
    spec = engine.head.spec
    return int(spec.num_codebooks * spec.codebook_size)


def main() -> None:
    p = argparse.ArgumentParser(prog="sample_host_time.py", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--sync", action="store_true", help="synchronize the device after each call")
    p.add_argument("--graphs", action="store_true", help="the draws from CUDA graphs")
    p.add_argument("--steps", default=None, help="a model shape: time whole decode steps")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(1)
    if args.steps:
        print(f"| decode step ({args.device}) | batch | ms a step |")
        print("|---|---|---|")
        for name, b, ms in steps(args.steps, args.device, batches, args.calls):
            print(f"| {name} | {b} | {ms:.3f} |")
        return
    base = {"max_total_tokens": 16384, "max_batch_size": max(batches), "device": args.device,
            "cuda_graphs": False}  # fmt: skip
    text = Engine.from_random(TEXT_SHAPE, EngineConfig.from_table(base))
    if args.graphs:
        text.head.capture_draws(max(batches), torch.device(args.device), None)
    rows = measure("text", text, list(range(1, 17)), batches, args.calls, args.sync)
    from omni_bench.random_checkpoint import write_higgs_audio_v2

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_higgs_audio_v2(Path(tmp) / "higgs", "tiny", seed=0)
        higgs = Engine.from_checkpoint(folder, EngineConfig.from_table(base))
        if args.graphs:
            higgs.head.capture_draws(max(batches), torch.device(args.device), None)
        audio = higgs.model.audio
        prompt = [*range(10, 40), audio.audio_bos_token_id]
        rows += measure("frames", higgs, prompt, batches, args.calls, args.sync)
    mode = f"{args.device}{', graphs' if args.graphs else ''}{', synced' if args.sync else ''}"
    print(f"| sampling ({mode}) | batch | us a call |")
    print("|---|---|---|")
    for name, b, us in rows:
        print(f"| {name} | {b} | {us:.0f} |")


if __name__ == "__main__":
    main()
