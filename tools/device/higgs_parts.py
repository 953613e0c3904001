"""The two parts of the Higgs pipeline that bound its serving, alone on the GPU, so the served
numbers (`omni-bench higgs-serve`) can be read against them. A device script, not an omni-bench
command: it times the engine's step in parts, which reaches inside the engine as the
benchmarks never do.

    python3 tools/device/higgs_parts.py --checkpoint DIR [--batches 1,16,64] [--lengths 14,22,38]
        [--windows 1,4,16,64] [--out DIR]

- **vocoder**: the audio tokenizer's decode of B windows of L columns (what one vocoder call
  does), eagerly and from the CUDA graphs the vocoder serves with (audio/decode_graphs.py):
  median ms a call over 30 calls with the host copy, ms a window, and the largest difference
  between the two outputs (random codes, fresh each call);
- **engine**: the frame step (`Engine.step()`, median of 40 all-decode steps) at each batch,
  with the served sampling (temperature 1, top-k 50, top-p 0.95, repetition-aware 7 / 2) and
  without repetition-aware sampling; then its parts, timed with a device sync around each:
  the model's forward (graph replay) and the frame sampling + bookkeeping.

Writes `OUT/higgs_parts.md` and `.json`. A full checkpoint is written to DIR first when DIR has
none (random weights drawn on the GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni_bench.harness import tables

PROMPT_TOKENS = 74


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_ms(fn: Any, calls: int) -> float:
    times = []
    for _ in range(calls):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _rotating(fn: Any, inputs: list[Any]) -> Any:
    """fn over the inputs in turn, one a call (not one buffer again and again)."""
    calls = iter(range(10**9))
    return lambda: fn(inputs[next(calls) % len(inputs)])


def _timed(parts: list[float], fn: Any) -> Any:
    """fn, its time (ms, a device sync at each end) appended to parts."""

    def wrapper(*a: Any) -> Any:
        _sync()
        start = time.perf_counter()
        out = fn(*a)
        _sync()
        parts.append((time.perf_counter() - start) * 1000)
        return out

    return wrapper


def vocoder(folder: Path, lengths: list[int], windows: list[int]) -> list[dict[str, Any]]:
    from omni_server.audio.decode_graphs import GraphedDecoder
    from omni_server.audio.higgs_codec import load_audio_tokenizer, open_checkpoint

    codec = load_audio_tokenizer(open_checkpoint({"checkpoint": str(folder)}), "cuda")
    k = int(codec.config.num_quantizers)
    real = int(codec.config.codebook_size)

    def eager(codes: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            values = codec.decode(torch.from_numpy(codes).cuda())
        return values[:, 0].float().cpu().numpy()

    graphs = GraphedDecoder(codec.decode, k, "cuda")
    rng = np.random.default_rng(0)
    rows = []
    for length in lengths:
        for b in windows:
            draw = [rng.integers(0, real, (b, k, length)) for _ in range(4)]
            diff = max(float(np.abs(eager(c) - graphs.decode(c)).max()) for c in draw)
            rows.append(
                {
                    "length": length,
                    "windows": b,
                    "eager_ms": _median_ms(_rotating(eager, draw), 30),
                    "graph_ms": _median_ms(_rotating(graphs.decode, draw), 30),
                    "max_abs_diff": diff,
                }
            )
            r = rows[-1]
            print(f"vocoder L={length} B={b}: eager {r['eager_ms']:.2f} ms, graph "
                  f"{r['graph_ms']:.2f} ms, max diff {diff:.2e}", flush=True)  # fmt: skip
    return rows


def engine(folder: Path, batches: list[int], device: str = "cuda") -> list[dict[str, Any]]:
    from omni_server.engine import Engine, EngineConfig, GenerationRequest, SamplingParams

    config = EngineConfig.from_table(
        {"device": device, "dtype": "bfloat16" if device == "cuda" else "float32",
         "cuda_graphs": device == "cuda", "max_total_tokens": 65536 if device == "cuda" else 4096,
         "max_batch_size": max(batches)}
    )  # fmt: skip
    eng = Engine.from_checkpoint(folder, config)
    audio = eng.model.audio
    assert audio is not None
    rng = np.random.default_rng(1)
    rows = []
    ids = iter(range(10**9))
    # ("before": the per-row sampler this A/B once ran against is gone; draw_frames is the
    # engine's only frame draw now, sampling.py's counter-based uniforms)
    for sampler, ras in (("now", 7), ("now", 0)):
        for b in batches:
            params = SamplingParams(
                temperature=1.0, top_k=50, top_p=0.95, max_tokens=400, ignore_eos=True,
                ras_window=ras, ras_max_repeat=2 if ras else 0, seed=b,
            )  # fmt: skip
            names = []
            for _ in range(b):
                top = min(100000, eng.shape.vocab_size - 256)  # under the special tokens
                prompt = rng.integers(10, top, PROMPT_TOKENS - 1).tolist()
                name = f"r{next(ids)}"
                eng.add(GenerationRequest(name, [*prompt, audio.audio_bos_token_id], params,
                                          playback_seconds=0.04))  # fmt: skip
                names.append(name)
            waiting = set(names)
            while waiting:  # prefill: until every request has its first frame
                waiting -= {event.request_id for event in eng.step()}
            for _ in range(5):
                eng.step()
            step = _median_ms(eng.step, 40)
            # the parts: the forward (graph replay, logits) and what follows it (sampling,
            # masks, bookkeeping), each closed by a sync
            run, sample = eng.runner.run, eng._sample
            parts: dict[str, list[float]] = {"forward": [], "sample": []}
            eng.runner.run = _timed(parts["forward"], run)  # type: ignore[method-assign]
            eng._sample = _timed(parts["sample"], sample)  # type: ignore[method-assign]
            synced = _median_ms(eng.step, 40)
            eng.runner.run, eng._sample = run, sample
            row = {
                "batch": b, "ras": ras, "sampler": sampler, "step_ms": step,
                "synced_step_ms": synced,
                "forward_ms": statistics.median(parts["forward"]),
                "sample_ms": statistics.median(parts["sample"]),
            }  # fmt: skip
            rows.append(row)
            forward, after = row["forward_ms"], row["sample_ms"]
            print(f"engine {sampler} b={b} ras={ras}: step {step:.2f} ms (forward {forward:.2f}, "
                  f"sample {after:.2f})", flush=True)  # fmt: skip
            for name in names:
                eng.abort(name)
            eng.step()
    return rows


def report(voc: list[dict[str, Any]], eng: list[dict[str, Any]]) -> str:
    lines = tables.header(
        ["window columns", "windows a call", "eager ms a call", "graph ms a call",
         "graph ms a window", "speed-up", "max abs diff"]
    )  # fmt: skip
    for r in voc:
        lines.append(tables.row([
            r["length"], r["windows"], f"{r['eager_ms']:.2f}", f"{r['graph_ms']:.2f}",
            f"{r['graph_ms'] / r['windows']:.3f}", f"{r['eager_ms'] / r['graph_ms']:.1f}x",
            f"{r['max_abs_diff']:.1e}",
        ]))  # fmt: skip
    lines.append("")
    lines += tables.header(
        ["sampler", "batch", "repetition-aware", "step ms", "frames/s", "synced step ms",
         "forward ms", "sampling + bookkeeping ms"]
    )  # fmt: skip
    for r in eng:
        lines.append(tables.row([
            r["sampler"], r["batch"], "7 / 2" if r["ras"] else "off", f"{r['step_ms']:.2f}",
            f"{r['batch'] * 1000 / r['step_ms']:.0f}", f"{r['synced_step_ms']:.2f}",
            f"{r['forward_ms']:.2f}", f"{r['sample_ms']:.2f}",
        ]))  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="higgs_parts.py", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="folder (written if empty)")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--lengths", default="14,22,38", help="window columns (the served ones)")
    p.add_argument("--windows", default="1,4,16,64", help="windows a decoder call")
    p.add_argument("--skip", default="", help="vocoder or engine: leave that part out")
    p.add_argument("--out", type=Path, default=Path("bench-results/higgs-parts"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("higgs_parts.py: needs a CUDA GPU")
        return 2
    if not (args.checkpoint / "config.json").is_file():
        from omni_bench import random_checkpoint

        random_checkpoint.main(
            ["higgs-audio-v2", "--size", "full", "--out", str(args.checkpoint), "--draw-on", "cuda"]
        )
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    voc = [] if "vocoder" in args.skip else vocoder(
        args.checkpoint, ints(args.lengths), ints(args.windows))  # fmt: skip
    eng = [] if "engine" in args.skip else engine(args.checkpoint, ints(args.batches))
    table = report(voc, eng)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "higgs_parts.md").write_text(table)
    (args.out / "higgs_parts.json").write_text(json.dumps({"vocoder": voc, "engine": eng}) + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
