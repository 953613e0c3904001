"""`omni-bench omni-serve`: Qwen3-Omni served over HTTP, text and speech out, closed loop.

examples/qwen3-omni served, chat with text and speech out, loaded closed loop by concurrency:

    omni-bench omni-serve --checkpoint DIR [--size tiny|full] [--gpu] [--concurrency 1,16,64]
        [--max-tokens 64] [--audio-seconds 6] [--rounds 2] [--out DIR] [-- SERVER ARGS]

Issue 37's "Measure" in one command. A random checkpoint is written to DIR first when DIR has
no config.json (`random-checkpoint qwen3-omni --size SIZE`; with --gpu, bfloat16 drawn on the
GPU). One server: `omni-server --repo examples/qwen3-omni --parameters.checkpoint DIR`, its
`device = "auto"` stages held to the GPU with --gpu (as the example places itself there: its
[on_gpu], bf16, MPS) or to the CPU without, and fixed work a request: random weights have no
end of text or speech worth waiting for, so the thinker and the talker ignore EOS, every
answer is `--max-tokens` tokens (the request's `max_completion_tokens`) and `--audio-seconds`
of speech (the talker's `max_audio_seconds`). The thinker and the talker take the largest
level as one batch; on the GPU the thinker's KV is pinned to what the run needs
(`--kv-tokens`: the example's 131072 tokens do not fit beside the full-size thinker's weights
in its 45 %).

Each level: c clients in a closed loop (`rounds x c` requests, at least `--min-requests`),
each a streamed `POST /v1/chat/completions` with `modalities: ["text", "audio"]`, pcm16 audio
in one of the model's voices, the text greedy (`--temperature` 0) and seeded, the speech
sampled as the talker stage's defaults say (temperature 0.9, top-k 50: a chat's `temperature`
is the text's) with the request's seed: every other
request is a short written question, the others a spoken one (an `input_audio` part: a
synthetic 16 kHz clip the bench makes once, `spoken_clip`: voiced harmonics in syllable-long
bursts, not words: a random model cannot tell speech from noise, and the audio tower's cost is
the clip's length). Per request: time to the first text delta (TTFT), to the first audio byte
(first audio), the audio seconds received, RTF (first audio byte -> last, over the audio
seconds), the finish reason. Per level: TTFT and first audio p50 / p95, RTF p50, requests/s,
audio seconds/s, failures; per server: the GPU's memory loaded and peak (nvidia-smi) with
--gpu. Then issue 37's targets, met or missed. Tables to stdout and `OUT/omni_serve.md`,
everything (every request too) in `OUT/omni_serve.json`, the server's log in `OUT/server.log`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import sys
import time
import wave
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from omni_bench.harness import tables
from omni_bench.harness.gpu import GpuMemory
from omni_bench.harness.served_args import add_served_options
from omni_bench.harness.server import OmniServer
from omni_bench.harness.timing import closed_loop, machine, percentiles
from omni_server.compiler import DeviceRequest, MachineFacts, compile_repository

# the example repository, relative to where the bench runs (a source checkout), as --repo
# defaults elsewhere: an installed omni_bench has no examples/ beside it
REPO = Path("examples/qwen3-omni")
MODEL = "qwen3-omni"
OUT_RATE = 24_000  # streamed chat audio: pcm16, mono, 24 kHz (OpenAI's and the example's)
CLIP_RATE = 16_000
SPOKEN_PROMPT = "Answer the question in the recording."
QUESTIONS = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Why is the sky blue?",
    "What time is it in Tokyo when it is noon in London?",
    "Name three primary colors.",
    "How do I boil an egg?",
    "What is two plus two?",
    "Who wrote Hamlet?",
)
# Issue 37's targets (vllm-omni's published run: c=64, 11.7 requests/s, on three GPUs)
TARGET_RPS_C64 = 11.7
TARGET_FIRST_AUDIO_P50_C64_S = 0.600
TARGET_FIRST_AUDIO_C1_S = 0.250


def spoken_clip(seconds: float = 2.0, seed: int = 0) -> bytes:
    """A short "spoken question": a 16 kHz mono WAV of voiced bursts (a 140 Hz fundamental
    and its harmonics, 200 ms "syllables" 2.5 a second, a little noise), the same every run.
    Synthetic, not speech (no voice is needed to load the model: its audio tower's work is
    the clip's length, about 13 embeddings a second)."""
    t = np.arange(int(seconds * CLIP_RATE)) / CLIP_RATE
    voiced = sum(np.sin(2 * np.pi * 140.0 * k * t) / k for k in range(1, 6))
    syllables = np.clip(np.sin(2 * np.pi * 2.5 * t), 0.0, None) ** 2
    noise = np.random.default_rng(seed).normal(0.0, 0.02, t.size)
    samples = 0.25 * voiced * syllables + noise
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(CLIP_RATE)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return out.getvalue()


@dataclass(frozen=True)
class Question:
    index: int  # the request's place in the level (its seed)
    spoken: bool
    text: str  # the written question, or the words beside the clip


def questions(requests: int) -> list[Question]:
    """Half written, half spoken, alternating, the same in every level."""
    return [
        Question(i, i % 2 == 1, SPOKEN_PROMPT if i % 2 else QUESTIONS[(i // 2) % len(QUESTIONS)])
        for i in range(requests)
    ]


@dataclass
class Answer:
    """One request, timed on the bench's clock from its send (seconds)."""

    index: int
    spoken: bool
    ok: bool
    ttft: float = math.nan  # to the first text delta (the audio's transcript)
    first_audio: float = math.nan  # to the first audio byte
    audio_seconds: float = 0.0  # pcm16 received / 2 / 24 kHz
    rtf: float = math.nan  # (last audio byte - first) / audio_seconds
    total: float = math.nan  # to the stream's end
    completion_tokens: int = 0
    finish_reason: str = ""
    error: str = ""


@dataclass
class Level:
    concurrency: int
    requests: int
    failed: int
    wall_seconds: float
    ttft: dict[str, float]
    first_audio: dict[str, float]
    rtf: dict[str, float]
    requests_per_second: float
    audio_seconds_per_second: float
    audio_seconds: dict[str, float]  # per request
    finish_reasons: dict[str, int]
    # TTFT and first audio p50 / p95 of the written and of the spoken questions apart
    by_question: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)


def summarize(concurrency: int, answers: list[Answer], wall: float) -> Level:
    ok = [a for a in answers if a.ok]
    finishes: dict[str, int] = {}
    for a in ok:
        finishes[a.finish_reason] = finishes.get(a.finish_reason, 0) + 1
    return Level(
        concurrency=concurrency,
        requests=len(answers),
        failed=len(answers) - len(ok),
        wall_seconds=wall,
        ttft=percentiles([a.ttft for a in ok]),
        first_audio=percentiles([a.first_audio for a in ok]),
        rtf=percentiles([a.rtf for a in ok if not math.isnan(a.rtf)]),
        requests_per_second=len(ok) / wall if wall > 0 else 0.0,
        audio_seconds_per_second=sum(a.audio_seconds for a in ok) / wall if wall > 0 else 0.0,
        audio_seconds=percentiles([a.audio_seconds for a in ok]),
        finish_reasons=finishes,
        by_question={
            kind: {
                "ttft": percentiles([a.ttft for a in ok if a.spoken is spoken], (50, 95)),
                "first_audio": percentiles(
                    [a.first_audio for a in ok if a.spoken is spoken], (50, 95)
                ),
            }
            for kind, spoken in (("written", False), ("spoken", True))
        },
        errors=sorted({a.error for a in answers if a.error})[:5],
        answers=[asdict(a) for a in sorted(answers, key=lambda a: a.index)],
    )


def request_body(q: Question, args: argparse.Namespace, clip_b64: str) -> dict[str, Any]:
    content: str | list[dict[str, Any]] = q.text
    if q.spoken:
        content = [
            {"type": "text", "text": q.text},
            {"type": "input_audio", "input_audio": {"data": clip_b64, "format": "wav"}},
        ]
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "modalities": ["text", "audio"],
        "audio": {"voice": args.voice, "format": "pcm16"},
        "max_completion_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": q.index,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def ask(http: aiohttp.ClientSession, url: str, q: Question, body: dict[str, Any]) -> Answer:
    """One streamed chat completion with audio, timed. A non-200, an error event, or a stream
    without text, audio, a finish reason or usage fails it."""
    answer = Answer(q.index, q.spoken, ok=False)
    sent = time.perf_counter()
    first_text = first_audio = last_audio = None
    pcm_bytes = 0
    async with http.post(f"{url}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            answer.error = f"HTTP {r.status}: {(await r.text())[:200]}"
            return answer
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if "error" in chunk:
                answer.error = f"error event: {str(chunk['error'])[:200]}"
                return answer
            if chunk.get("usage"):
                answer.completion_tokens = int(chunk["usage"]["completion_tokens"])
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                audio = delta.get("audio") or {}
                if (delta.get("content") or audio.get("transcript")) and first_text is None:
                    first_text = now
                if audio.get("data"):
                    pcm_bytes += len(base64.b64decode(audio["data"]))
                    first_audio = first_audio or now
                    last_audio = now
                if choice.get("finish_reason"):
                    answer.finish_reason = choice["finish_reason"]
    answer.total = time.perf_counter() - sent
    missing = [
        what
        for what, seen in (
            ("text", first_text),
            ("audio", first_audio),
            ("finish_reason", answer.finish_reason),
            ("usage", answer.completion_tokens),
        )
        if not seen
    ]
    if missing:
        answer.error = "no " + ", no ".join(missing) + " in the stream"
        return answer
    assert first_text is not None and first_audio is not None and last_audio is not None
    answer.ok = True
    answer.ttft = first_text - sent
    answer.first_audio = first_audio - sent
    answer.audio_seconds = pcm_bytes / 2 / OUT_RATE
    if answer.audio_seconds > 0:
        answer.rtf = (last_audio - first_audio) / answer.audio_seconds
    return answer


async def run_level(url: str, concurrency: int, requests: int, args: argparse.Namespace) -> Level:
    clip_b64 = base64.b64encode(spoken_clip(args.clip_seconds)).decode("ascii")
    answers: list[Answer] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    limits = aiohttp.TCPConnector(limit=0)  # no pool cap: the level's concurrency is the load
    async with aiohttp.ClientSession(timeout=timeout, connector=limits) as http:

        async def one(q: Question) -> None:
            try:
                answers.append(await ask(http, url, q, request_body(q, args, clip_b64)))
            except (aiohttp.ClientError, TimeoutError) as e:  # the request failed, not the run
                answers.append(
                    Answer(q.index, q.spoken, ok=False, error=f"{type(e).__name__}: {e}")
                )

        wall = await closed_loop(questions(requests), concurrency, one)
    return summarize(concurrency, answers, wall)


def placement_overrides(repo: Path, gpu: bool) -> list[str]:
    """The example's `device = "auto"` stages held to the GPU (`--gpu`: a machine without one
    fails the start instead of running on the CPU, and the example's [on_gpu] applies) or to
    the CPU (even on a GPU machine)."""
    plan = compile_repository(repo, machine=MachineFacts(gpus=1))  # as on a GPU machine
    device = "gpu" if gpu else "cpu"
    out = []
    for stage in plan.stages.values():
        if stage.device is DeviceRequest.AUTO:
            out += [f"--stages.{stage.name}.device", device]
    return out


def kv_tokens(args: argparse.Namespace) -> int:
    """The thinker's pinned KV on the GPU: --kv-tokens, else the largest level's requests at a
    128-token prompt (a 2 s clip and its words are ~60) plus their answers, a quarter more, in
    4096s. Small on purpose: the full-size thinker's ~57 GiB of weights leave ~4 GiB of its 45 %
    of an H200 for the KV and the workspace (the example's 131072 tokens would need 12 GiB)."""
    if args.kv_tokens is not None:
        return int(args.kv_tokens)
    need = max(args.levels) * (128 + args.max_tokens) * 5 // 4
    return -(-need // 4096) * 4096


def serve_args(args: argparse.Namespace) -> list[str]:
    plan = compile_repository(args.repo, machine=MachineFacts(gpus=1))
    batch = max(args.levels)
    out = [
        "--parameters.checkpoint", str(args.checkpoint),
        "--max-in-flight", str(max(64, 2 * batch)),
        "--stages.thinker.parameters.ignore_eos", "true",
        "--stages.talker.parameters.ignore_eos", "true",
        "--stages.talker.parameters.max_audio_seconds", f"{args.audio_seconds:g}",
    ]  # fmt: skip
    for name in ("thinker", "talker"):  # the largest level steps as one batch
        engine = plan.stages[name].engine
        declared = engine.settings.get("max_batch_size", 0) if engine is not None else 0
        if batch > declared:
            out += [f"--stages.{name}.engine.max_batch_size", str(batch)]
    if args.gpu:
        out += ["--stages.thinker.engine.max_total_tokens", str(kv_tokens(args))]
    out += placement_overrides(args.repo, args.gpu)
    return out + args.extra


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    argv = serve_args(args)
    server = OmniServer(
        args.repo, argv, ready_timeout_s=args.ready_timeout, log=args.out / "server.log"
    )
    gpu = GpuMemory()
    levels: list[Level] = []
    with gpu:
        started = time.perf_counter()
        await server.start()
        ready_s = time.perf_counter() - started
        print(f"# server ready in {ready_s:.0f} s", flush=True)
        try:
            loaded = gpu.now()
            if args.warmup:
                await run_level(server.url, 1, args.warmup, args)  # unmeasured: graphs, caches
            for c in args.levels:
                requests = max(args.min_requests, args.rounds * c)
                levels.append(await run_level(server.url, c, requests, args))
                print(f"# c={c} done", flush=True)
        finally:
            await server.stop()
    return {
        "checkpoint": str(args.checkpoint),
        "gpu": args.gpu,
        "max_tokens": args.max_tokens,
        "audio_seconds": args.audio_seconds,
        "voice": args.voice,
        "spoken_clip": f"synthetic, {args.clip_seconds:g} s, 16 kHz (omni_serve.spoken_clip)",
        "serve_args": argv,
        "server_ready_s": ready_s,
        "gpu_mib_loaded": loaded,
        "gpu_mib_peak": gpu.peak,
        "leftovers": "" if server.left.clean else str(server.left),
        "machine": machine(),
        "levels": [asdict(level) for level in levels],
    }


def _ms(value: float) -> str:
    return "" if math.isnan(value) else f"{value * 1000:.0f}"


def targets(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Issue 37's targets: (target, goal, measured, met / missed / not run)."""
    by_c = {lv["concurrency"]: lv for lv in result["levels"]}
    rows = []

    def check(name: str, goal: str, c: int, value: Any, met: Any) -> None:
        level = by_c.get(c)
        if level is None:
            rows.append((name, goal, "", f"not run (no c={c})"))
        else:
            measured = value(level)
            rows.append((name, goal, measured[0], "met" if met(measured[1]) else "missed"))

    check(
        "requests/s at c=64", f">= {TARGET_RPS_C64}", 64,
        lambda lv: (f"{lv['requests_per_second']:.2f}", lv["requests_per_second"]),
        lambda v: v >= TARGET_RPS_C64,
    )  # fmt: skip
    check(
        "first audio p50 at c=64", f"<= {TARGET_FIRST_AUDIO_P50_C64_S * 1000:.0f} ms", 64,
        lambda lv: (f"{_ms(lv['first_audio']['p50'])} ms", lv["first_audio"]["p50"]),
        lambda v: v <= TARGET_FIRST_AUDIO_P50_C64_S,
    )  # fmt: skip
    check(
        "first audio p50 at c=1", f"<= {TARGET_FIRST_AUDIO_C1_S * 1000:.0f} ms", 1,
        lambda lv: (f"{_ms(lv['first_audio']['p50'])} ms", lv["first_audio"]["p50"]),
        lambda v: v <= TARGET_FIRST_AUDIO_C1_S,
    )  # fmt: skip
    return rows


def report(result: dict[str, Any]) -> str:
    columns = [
        "concurrency", "requests", "failed", "TTFT p50 ms", "TTFT p95 ms",
        "first audio p50 ms", "first audio p95 ms", "RTF p50", "req/s", "audio s/s",
        "audio s / request",
    ]  # fmt: skip
    lines = tables.header(columns, "r" * len(columns))
    for lv in result["levels"]:
        lines.append(
            tables.row(
                [
                    lv["concurrency"], lv["requests"], lv["failed"], _ms(lv["ttft"]["p50"]),
                    _ms(lv["ttft"]["p95"]), _ms(lv["first_audio"]["p50"]),
                    _ms(lv["first_audio"]["p95"]), f"{lv['rtf']['p50']:.3f}",
                    f"{lv['requests_per_second']:.2f}", f"{lv['audio_seconds_per_second']:.1f}",
                    f"{lv['audio_seconds']['p50']:.2f}",
                ]
            )
        )  # fmt: skip
    lines += ["", *tables.header(["GPU MiB loaded", "GPU MiB peak", "server ready s"], "rrr")]
    lines.append(
        tables.row(
            [result["gpu_mib_loaded"], result["gpu_mib_peak"], f"{result['server_ready_s']:.0f}"]
        )
    )
    lines += ["", *tables.header(["target (issue 37)", "goal", "measured", "result"])]
    lines += [tables.row(r) for r in targets(result)]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omni-bench omni-serve", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--repo", type=Path, default=REPO, help=f"the Qwen3-Omni repository ({REPO})")
    p.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="the checkpoint folder (a random one written there if it has no config.json)",
    )
    p.add_argument("--size", choices=("tiny", "full"), default="full", help="when written (full)")
    p.add_argument(
        "--gpu",
        action="store_true",
        help="on the GPU, as the example places itself there (default: on the CPU)",
    )
    p.add_argument("--concurrency", default="1,16,64", help="closed-loop levels (1,16,64)")
    p.add_argument("--max-tokens", type=int, default=64, help="text tokens every answer (64)")
    p.add_argument("--audio-seconds", type=float, default=6.0, help="speech every answer (6)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests first (2)")
    p.add_argument("--clip-seconds", type=float, default=2.0, help="the spoken question (2)")
    p.add_argument("--voice", default="ethan", help="one of the model's voices (ethan)")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's (text) temperature (0: greedy; the speech samples as the talker "
        "stage's parameters say), seeded by the request's index",
    )
    p.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help="--gpu: the thinker's pinned KV tokens (default: what the largest level needs)",
    )
    add_served_options(p, "omni-serve", 600.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.levels = [int(c) for c in args.concurrency.split(",")]
        if min(args.levels) < 1 or args.max_tokens < 1 or args.warmup < 0:
            raise ValueError(args.levels)
        if not (args.audio_seconds > 0 and args.clip_seconds > 0 and args.rounds >= 1):
            raise ValueError(args.audio_seconds)
    except ValueError:
        print(
            "omni-bench omni-serve: --concurrency: integers >= 1, comma separated; "
            "--max-tokens, --rounds: at least 1; --audio-seconds, --clip-seconds: above 0; "
            "--warmup: at least 0",
            file=sys.stderr,
        )
        return 2
    if not (args.repo / "repository.toml").is_file():
        print(f"omni-bench omni-serve: --repo {args.repo}: no repository.toml", file=sys.stderr)
        return 2
    if not (args.checkpoint / "config.json").is_file():
        from omni_bench import random_checkpoint

        draw = ["--draw-on", "cuda", "--dtype", "bfloat16"] if args.gpu else []
        random_checkpoint.main(
            ["qwen3-omni", "--size", args.size, "--out", str(args.checkpoint), *draw]
        )
    args.checkpoint = args.checkpoint.resolve()  # the stages resolve paths against their own
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"# omni-serve: {args.checkpoint}, gpu={args.gpu}", flush=True)
    try:
        result = asyncio.run(bench(args))
    except RuntimeError as e:  # the server did not start: its log says why
        print(f"omni-bench omni-serve: {e}", file=sys.stderr)
        print(
            f"omni-bench omni-serve: the server's log: {args.out / 'server.log'}", file=sys.stderr
        )
        return 1
    (args.out / "omni_serve.json").write_text(json.dumps(result, indent=2) + "\n")
    table = report(result)
    (args.out / "omni_serve.md").write_text(table)
    print(table)
    failed = sum(lv["failed"] for lv in result["levels"])
    return 1 if failed or result["leftovers"] else 0


if __name__ == "__main__":
    sys.exit(main())
