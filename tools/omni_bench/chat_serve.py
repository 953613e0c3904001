"""`omni-bench chat-serve`: the thinker served over HTTP (the embedded repository's `smol-chat`,
`POST /v1/chat/completions`, streamed), loaded closed loop at each concurrency.

    omni-bench chat-serve [--checkpoint DIR [--family llama|qwen3-omni] [--size full]] [--gpu]
        [--concurrency 1,16,64] [--max-tokens 128] [--rounds 2] [--out DIR] [-- SERVER ARGS]

One server (`omni-server --repo repository`, only the chat model loaded: `--model-control-mode
explicit --load-model smol-chat`) runs the thinker stage on the embedded SmolLM2-135M, or with
--checkpoint on another model (the stage's `parameters.checkpoint`; a random one is written to
DIR first when DIR has none: `random-checkpoint FAMILY --size SIZE`, drawn on the GPU with
--gpu). With --gpu the stage runs on the GPU in bfloat16 with --kv-tokens of KV and up to the
largest concurrency in a batch; without, on the CPU as the repository declares it. Every
answer decodes exactly --max-tokens tokens (the stage's `parameters.ignore_eos`: random weights
have no end worth waiting for), greedy, from the same questions in the same order at every level.

Per level: time to first token (request sent -> first content delta) p50/p95, each request's
decode rate after its first token ((tokens - 1) / (last delta - first delta)) p50, all tokens
generated over the level's wall time (tokens/s), requests/s, failures. Tables to stdout and
`OUT/chat_serve.md`, everything in `OUT/chat_serve.json`, the server's log in `OUT/server.log`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from omni_bench.chat import QUESTIONS
from omni_bench.harness import tables
from omni_bench.harness.served_args import add_served_options
from omni_bench.harness.server import OmniServer
from omni_bench.harness.timing import closed_loop, percentiles

REPO = Path("repository")  # the embedded repository, relative to a source checkout
MODEL = "smol-chat"  # its chat model: the thinker alone
SIZES = ("tiny", "full")
FAMILIES = ("llama", "qwen3-omni")


@dataclass
class Answer:
    """One request's timing: seconds on the bench's clock from the request's send."""

    ok: bool
    ttft: float = 0.0  # to the first content delta
    decode_s: float = 0.0  # first delta -> last delta
    tokens: int = 0  # completion tokens (the usage chunk)
    error: str = ""


@dataclass
class Level:
    concurrency: int
    requests: int
    failed: int
    wall_seconds: float
    ttft: dict[str, float]
    decode_tokens_per_s: dict[str, float]  # per request, after its first token
    tokens_per_s: float  # every completion token of the level over its wall time
    requests_per_s: float
    errors: list[str] = field(default_factory=list)


def summarize(concurrency: int, answers: list[Answer], wall: float) -> Level:
    ok = [a for a in answers if a.ok]
    return Level(
        concurrency=concurrency,
        requests=len(answers),
        failed=len(answers) - len(ok),
        wall_seconds=wall,
        ttft=percentiles([a.ttft for a in ok]),
        decode_tokens_per_s=percentiles(
            [(a.tokens - 1) / a.decode_s for a in ok if a.tokens > 1 and a.decode_s > 0]
        ),
        tokens_per_s=sum(a.tokens for a in ok) / wall if wall > 0 else 0.0,
        requests_per_s=len(ok) / wall if wall > 0 else 0.0,
        errors=sorted({a.error for a in answers if a.error})[:5],
    )


async def ask(http: aiohttp.ClientSession, url: str, question: str, max_tokens: int) -> Answer:
    """One streamed chat completion, timed; a non-200 or a stream without usage fails it."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = last = None
    tokens = None
    async with http.post(f"{url}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            return Answer(ok=False, error=f"HTTP {r.status}: {(await r.text())[:200]}")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            for choice in chunk.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    last = time.perf_counter()
                    first = first or last
    if first is None or last is None or tokens is None:
        return Answer(ok=False, error="no content or no usage in the stream")
    return Answer(ok=True, ttft=first - sent, decode_s=last - first, tokens=tokens)


async def run_level(url: str, concurrency: int, requests: int, max_tokens: int) -> Level:
    answers: list[Answer] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    limits = aiohttp.TCPConnector(limit=0)  # no pool cap: the level's concurrency is the load
    async with aiohttp.ClientSession(timeout=timeout, connector=limits) as http:

        async def one(question: str) -> None:
            answers.append(await ask(http, url, question, max_tokens))

        jobs = (QUESTIONS[i % len(QUESTIONS)] for i in range(requests))
        wall = await closed_loop(jobs, concurrency, one)
    return summarize(concurrency, answers, wall)


def serve_args(args: argparse.Namespace) -> list[str]:
    """The server's command line: the chat model alone, on --checkpoint's model, held to the
    GPU with --gpu."""
    stage = "--stages.thinker"
    out = [
        "--model-control-mode", "explicit", "--load-model", MODEL,
        "--max-in-flight", str(max(64, 2 * max(args.levels))),
        f"{stage}.parameters.ignore_eos", "true",
    ]  # fmt: skip
    if args.checkpoint is not None:
        out += [f"{stage}.parameters.checkpoint", str(args.checkpoint)]
    if args.gpu:
        out += [
            f"{stage}.device", "gpu",
            f"{stage}.engine.dtype", "bfloat16",
            f"{stage}.engine.max_batch_size", str(max(args.levels)),
            f"{stage}.engine.max_total_tokens", str(args.kv_tokens),
            f"{stage}.engine.max_step_tokens", "2048",
            f"{stage}.engine.cpu_weight_order", "rows",
        ]  # fmt: skip
    return out + args.extra


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    args.out.mkdir(parents=True, exist_ok=True)
    server = OmniServer(
        args.repo, serve_args(args), ready_timeout_s=args.ready_timeout, log=args.out / "server.log"
    )
    await server.start()
    try:
        await run_level(server.url, 1, args.warmup, args.max_tokens)  # unmeasured
        levels = []
        for c in args.levels:
            requests = max(args.min_requests, args.rounds * c)
            levels.append(await run_level(server.url, c, requests, args.max_tokens))
            print(f"# c={c} done", flush=True)
    finally:
        await server.stop()
    return {
        "checkpoint": str(args.checkpoint) if args.checkpoint else "embedded SmolLM2-135M",
        "gpu": args.gpu,
        "max_tokens": args.max_tokens,
        "serve_args": serve_args(args),
        "leftovers": "" if server.left.clean else str(server.left),
        "levels": [asdict(level) for level in levels],
    }


def _ms(value: float) -> str:
    return f"{value * 1000:.0f}"


def report(result: dict[str, Any]) -> str:
    columns = [
        "concurrency", "requests", "failed", "TTFT p50 ms", "TTFT p95 ms",
        "decode tok/s per request p50", "tokens/s", "req/s",
    ]  # fmt: skip
    lines = tables.header(columns)
    for lv in result["levels"]:
        lines.append(
            tables.row(
                [
                    lv["concurrency"], lv["requests"], lv["failed"], _ms(lv["ttft"]["p50"]),
                    _ms(lv["ttft"]["p95"]), f"{lv['decode_tokens_per_s']['p50']:.1f}",
                    f"{lv['tokens_per_s']:.1f}", f"{lv['requests_per_s']:.2f}",
                ]
            )
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omni-bench chat-serve", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--repo", type=Path, default=REPO, help=f"the repository ({REPO})")
    p.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="the thinker's model: a checkpoint folder (a random one written if it has no "
        "config.json) or a GGUF file (default: the embedded SmolLM2-135M)",
    )
    p.add_argument("--family", choices=FAMILIES, default="llama", help="when written (llama)")
    p.add_argument("--size", choices=SIZES, default="full", help="when written (full)")
    p.add_argument("--gpu", action="store_true", help="the thinker on the GPU, bfloat16")
    p.add_argument("--concurrency", default="1,16,64", help="closed-loop levels (1,16,64)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens every answer decodes")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests first (2)")
    p.add_argument("--kv-tokens", type=int, default=65536, help="--gpu: KV tokens (65536)")
    add_served_options(p, "chat-serve", 400.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.levels = [int(c) for c in args.concurrency.split(",")]
        if min(args.levels) < 1 or args.max_tokens < 2 or args.warmup < 0:
            raise ValueError(args.levels)
    except ValueError:
        print(
            "omni-bench chat-serve: --concurrency: integers >= 1, comma separated; "
            "--max-tokens: at least 2; --warmup: at least 0",
            file=sys.stderr,
        )
        return 2
    if not (args.repo / "repository.toml").is_file():
        print(f"omni-bench chat-serve: --repo {args.repo}: no repository.toml", file=sys.stderr)
        return 2
    checkpoint = args.checkpoint
    if checkpoint is not None and not checkpoint.is_file():
        if not (checkpoint / "config.json").is_file():
            from omni_bench import random_checkpoint

            draw = ["--draw-on", "cuda"] if args.gpu else []
            random_checkpoint.main(
                [args.family, "--size", args.size, "--out", str(checkpoint), *draw]
            )
        args.checkpoint = checkpoint.resolve()  # the stage resolves paths against its own
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"# chat-serve: {args.checkpoint or 'embedded SmolLM2-135M'}, gpu={args.gpu}")
    result = asyncio.run(bench(args))
    (args.out / "chat_serve.json").write_text(json.dumps(result, indent=2) + "\n")
    table = report(result)
    (args.out / "chat_serve.md").write_text(table)
    print(table)
    failed = sum(lv["failed"] for lv in result["levels"])
    return 1 if failed or result["leftovers"] else 0


if __name__ == "__main__":
    sys.exit(main())
