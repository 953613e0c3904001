"""omni-bench cpu-step: the engine's batch-1 decode step on the CPU against transformers', one run.

    python -m omni_bench.cpu_step --threads 1 --rounds 7            # the embedded SmolLM2 (GGUF)
    python -m omni_bench.cpu_step --random-shape smollm2-135m --profile

One request (a chat prompt of the embedded model, or --prompt-tokens random ids) decodes
--new-tokens tokens greedily, EOS ignored; every decode step is timed. Three sides, interleaved
round by round in one process (same weights, dtype and intra-op thread count), so load drift on a
shared machine hits them alike:

  engine        `engine.step()`: schedule, forward over the paged KV cache, sampling, detokenizing
  hf-generate   transformers' `generate`, a step = the time between two tokens handed to its
                streamer (the forward, its DynamicCache, logits processing, stopping criteria):
                how `omni-bench chat` measures the peer's decode rate
  hf-forward    transformers' forward alone on one new token with its cache, plus the argmax

Each round gives one median per side, by wall time and by the thread's CPU time (what a loaded
machine's waits for a core do not inflate); the table prints the median over rounds, the rounds'
spread (min-max) and the engine's speed-up over each peer. `--thin` runs SmolLM2's 30 layers and
heads with tiny matrices: what a step costs besides reading weights. `--profile N` adds
torch.profiler's breakdown of N decode steps of each side: the ATen ops called from Python, per
kind, with their count and time a step, and the time outside any op (Python between the ops).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from omni_bench.chat import QUESTIONS, load_hf
from omni_server.engine import (
    SHAPES,
    SMOLLM2_135M,
    Engine,
    EngineConfig,
    GenerationRequest,
    LlamaShape,
    SamplingParams,
)

SIDES = ("engine", "hf-generate", "hf-forward")
# ATen ops of the weight matmuls (a linear reaches mm / addmm inside; counted once, at the top)
MATMUL_OPS = {"aten::linear", "aten::mm", "aten::addmm", "aten::mv", "aten::addmv"}


@dataclass
class Result:
    setup: dict[str, Any]
    # per side, per round: the medians of its decode steps' (wall ms, CPU ms)
    rounds: dict[str, list[tuple[float, float]]] = field(
        default_factory=lambda: {s: [] for s in SIDES}
    )
    profile: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


# --- the three sides: each returns its decode steps' (wall ms, CPU ms) -----------------------


def _now() -> tuple[float, float]:
    """Wall and this thread's CPU clock, in ms. With one intra-op thread every op runs on the
    calling thread, so its CPU time is the step's work without the waits for a core that a
    loaded machine adds to the wall time (memory contention it still feels)."""
    return time.perf_counter() * 1e3, time.thread_time() * 1e3


def _gaps(stamps: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(stamps)]


def engine_steps(
    engine: Engine, prompt: list[int], new_tokens: int, rid: str
) -> list[tuple[float, float]]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine.add(GenerationRequest(rid, prompt, params))
    engine.step()  # the prefill and the first token
    steps = []
    while engine.has_work():
        start = _now()
        engine.step()
        steps.append(_gaps([start, _now()])[0])
    return steps


class _StepClock:
    """A `generate` streamer that stamps each token handed to it (the prompt comes first)."""

    def __init__(self) -> None:
        self.stamps: list[tuple[float, float]] = []
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.stamps.append(_now())

    def end(self) -> None:
        pass


def hf_generate_steps(model: Any, prompt: list[int], new_tokens: int) -> list[tuple[float, float]]:
    clock = _StepClock()
    with torch.inference_mode():
        model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            streamer=clock,
        )
    return _gaps(clock.stamps)  # [first token, ..., last]: a step is the gap between two


def hf_forward_steps(model: Any, prompt: list[int], new_tokens: int) -> list[tuple[float, float]]:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    steps = []
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        for _ in range(new_tokens - 1):
            start = _now()
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            steps.append(_gaps([start, _now()])[0])
    return steps


# --- the profile ------------------------------------------------------------------------------


def profile_steps(run: Any, steps: int) -> list[dict[str, Any]]:
    """Top-level ATen ops of `steps` decode steps by kind: calls and us per step, plus the
    time outside any op. `run(step)` runs decode step number `step` inside the marker."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            with record_function("decode_step"):
                run(i)
    events = prof.events()
    marks = [e for e in events if e.name == "decode_step"]
    wall = sum(e.cpu_time_total for e in marks)
    calls: dict[str, int] = defaultdict(int)
    us: dict[str, float] = defaultdict(float)
    for e in events:
        if e.cpu_parent is not None and e.cpu_parent.name == "decode_step":
            kind = "matmul (weights)" if e.name in MATMUL_OPS else e.name
            calls[kind] += 1
            us[kind] += e.cpu_time_total
    rows = [
        {"kind": k, "calls": calls[k] / steps, "us": us[k] / steps}
        for k in sorted(us, key=lambda k: -us[k])
    ]
    inside = sum(us.values())
    rows.append({"kind": "outside ops (Python)", "calls": 0.0, "us": (wall - inside) / steps})
    rows.append({"kind": "step", "calls": sum(calls.values()) / steps, "us": wall / steps})
    return rows


def engine_profile(engine: Engine, prompt: list[int], steps: int) -> list[dict[str, Any]]:
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    engine.add(GenerationRequest("profile", prompt, params))
    engine.step()
    engine.step()
    rows = profile_steps(lambda _: engine.step(), steps)
    while engine.has_work():
        engine.step()
    return rows


def hf_profile(model: Any, prompt: list[int], steps: int) -> list[dict[str, Any]]:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    state: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        state["token"] = out.logits[:, -1].argmax(dim=-1, keepdim=True)

        def step(_: int) -> None:
            logits = model(input_ids=state["token"], past_key_values=cache, use_cache=True).logits
            state["token"] = logits[:, -1].argmax(dim=-1, keepdim=True)

        step(0)
        return profile_steps(step, steps)


# --- driver -------------------------------------------------------------------------------


def shape_of(args: argparse.Namespace) -> LlamaShape:
    if args.thin:  # SmolLM2's layers and heads, 8-wide heads, a tiny MLP and vocabulary
        return dataclasses.replace(
            SMOLLM2_135M, hidden_size=72, head_dim=8, intermediate_size=64, vocab_size=256
        )
    return SHAPES[args.random_shape] if args.random_shape else SMOLLM2_135M


def build(args: argparse.Namespace) -> tuple[Engine, list[int]]:
    config = EngineConfig(
        max_total_tokens=8192,
        max_batch_size=4,
        dtype=args.dtype,
        cpu_weight_order=args.cpu_weight_order,
    )
    if args.random_shape is None and not args.thin:
        engine = _prepared_engine(config) if args.prepared else Engine.from_gguf(config)
        assert engine.tokenizer is not None
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[0]}])
        return engine, prompt
    shape = shape_of(args)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, shape.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
    return Engine.from_random(shape, config), prompt


def _prepared_engine(config: EngineConfig) -> Engine:
    """The embedded GGUF as a restarted thinker runs it: on the weights a first load prepared,
    mapped read-only from the prepared file (engine/prepared.py) instead of its own copy in
    huge pages. The file is removed at once; the mapping keeps it until the engine goes."""
    with tempfile.TemporaryDirectory() as directory:
        Engine.from_gguf(config, prepared=Path(directory))  # prepares and writes the file
        return Engine.from_gguf(config, prepared=Path(directory))  # maps it


def table(result: Result) -> str:
    lines = [
        f"{'side':<12} {'wall ms/step':>12} {'rounds min-max':>15} {'tok/s':>6}"
        f" {'CPU ms/step':>11} {'rounds min-max':>15}"
    ]
    wall, cpu = {}, {}
    for side, rounds in result.rounds.items():
        walls, cpus = [r[0] for r in rounds], [r[1] for r in rounds]
        wall[side], cpu[side] = statistics.median(walls), statistics.median(cpus)
        lines.append(
            f"{side:<12} {wall[side]:>12.2f} {f'{min(walls):.2f}-{max(walls):.2f}':>15}"
            f" {1e3 / wall[side]:>6.1f} {cpu[side]:>11.2f} {f'{min(cpus):.2f}-{max(cpus):.2f}':>15}"
        )
    for peer in ("hf-generate", "hf-forward"):
        if "engine" in wall and peer in wall:
            lines.append(
                f"engine vs {peer}: {wall[peer] / wall['engine']:.2f}x by wall time, "
                f"{cpu[peer] / cpu['engine']:.2f}x by CPU time"
                + (" (target >= 1.2x)" if peer == "hf-generate" else "")
            )
    for side, rows in result.profile.items():
        lines.append(f"profile {side}: {'calls/step':>10} {'us/step':>9}")
        for row in rows:
            lines.append(f"  {row['kind']:<30} {row['calls']:>10.1f} {row['us']:>9.0f}")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="omni-bench cpu-step", description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both sides)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median reported)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens each round decodes")
    p.add_argument(
        "--random-shape",
        choices=sorted(SHAPES),
        default=None,
        help="random weights of this Llama shape instead of the embedded GGUF",
    )
    p.add_argument(
        "--thin",
        action="store_true",
        help="random weights of SmolLM2's layers and heads with tiny matrices: the step's "
        "cost besides reading weights (Python, small ops, cache, sampling)",
    )
    p.add_argument(
        "--cpu-weight-order",
        choices=("columns", "rows"),
        default="columns",
        help="the engine's weight layout (the embedded thinker's: columns; EngineConfig)",
    )
    p.add_argument(
        "--prepared",
        action="store_true",
        help="the embedded GGUF's weights mapped from a prepared file, as a restarted thinker "
        "runs on them (file pages), instead of the engine's own huge-page copy",
    )
    p.add_argument("--prompt-tokens", type=int, default=40, help="random-weight prompts only")
    p.add_argument("--no-peer", action="store_true", help="the engine alone (no transformers)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS", help="profile STEPS steps")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.new_tokens < 3 or args.threads < 1 or args.profile < 0:
        p.error("--rounds and --threads must be >= 1, --new-tokens >= 3, --profile >= 0")
    if args.thin and args.random_shape:
        p.error("--thin and --random-shape are exclusive")
    if args.prepared and (args.thin or args.random_shape):
        p.error("--prepared is of the embedded GGUF: not with --thin or --random-shape")
    return args


def _round(steps: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(s[0] for s in steps), statistics.median(s[1] for s in steps)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    engine, prompt = build(args)
    hf = None
    if not args.no_peer:
        args.device = "cpu"  # what load_hf reads; a random shape builds from `shape`
        if args.thin:
            args.random_shape = "thin"
        hf = load_hf(args, shape_of(args))
    setup = {
        "dtype": args.dtype,
        "cpu_weight_order": args.cpu_weight_order,
        "threads": torch.get_num_threads(),
        "model": args.random_shape or "SmolLM2-135M-Instruct (GGUF, dequantized)",
        "prompt_tokens": len(prompt),
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "torch": torch.__version__,
        "load_avg_before": os.getloadavg()[0],
    }
    result = Result(setup)
    engine.warmup()
    if hf is not None:
        hf_generate_steps(hf, prompt, 3)
    sides = SIDES if hf is not None else SIDES[:1]
    for r in range(args.rounds):
        order = sides if r % 2 == 0 else sides[::-1]  # no side always first
        for side in order:
            if side == "engine":
                steps = engine_steps(engine, prompt, args.new_tokens, f"r{r}")
            elif side == "hf-generate":
                steps = hf_generate_steps(hf, prompt, args.new_tokens)
            else:
                steps = hf_forward_steps(hf, prompt, args.new_tokens)
            result.rounds[side].append(_round(steps))
        done = ", ".join(f"{s} {v[-1][0]:.2f}" for s, v in result.rounds.items() if v)
        print(f"round {r} (wall ms/step): {done}", file=sys.stderr)
    result.rounds = {s: v for s, v in result.rounds.items() if v}
    if args.profile:
        result.profile["engine"] = engine_profile(engine, prompt, args.profile)
        if hf is not None:
            result.profile["hf-forward"] = hf_profile(hf, prompt, args.profile)
    setup["load_avg_after"] = os.getloadavg()[0]
    print(json.dumps(setup))
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(result), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
