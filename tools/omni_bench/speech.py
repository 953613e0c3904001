"""`omni-bench speech`: the load driver.

For each concurrency level and each target (our server, then each peer), `concurrency` workers
share one queue of `requests` texts taken in order from the dataset (wrapping around) and each
sends its next request as soon as its previous one ends: closed-loop load, the same texts in the
same order for every target. With `--rate`, the load is open instead: requests arrive at that
rate (Poisson arrivals, the same seeded schedule for every target) whether or not earlier ones
have ended, as a service's users send them. Only one target is under load at a time, so they
never compete for the CPU; levels are interleaved across targets (c=1 on each, then c=2 on
each, ...) so that other work on the machine affects every target alike. The first clip
returned for each text is kept for `--wer`, which runs only after all timing is done.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from omni_bench import proc_cpu, report, server_stats
from omni_bench.harness.server import OmniServer, ServerLeftovers
from omni_bench.harness.timing import closed_loop, machine, open_loop
from omni_bench.metrics import LevelSummary, RequestTiming, summarize
from omni_bench.peers import PEERS, make_peer
from omni_bench.targets import OpenAISpeechTarget, SpeechTarget
from omni_server.audio.decode import Clip

DEFAULT_DATASET = Path(__file__).parent / "data" / "sentences.txt"
FORMATS = ("pcm", "wav", "mp3", "opus", "aac", "flac")
DEFAULT_CONCURRENCY = "1,2,4,8,16"


class UsageError(Exception):
    """Bad command-line input: reported as one line with exit code 2."""


def load_dataset(path: Path) -> list[str]:
    """One text per line (a sentence or a short paragraph); blank lines and `#` lines skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise UsageError(f"--dataset {path}: {err.strerror}") from err
    texts = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not texts:
        raise UsageError(f"--dataset {path}: no texts (one per line expected)")
    return texts


@dataclass
class TargetResult:
    name: str
    levels: list[LevelSummary] = field(default_factory=list)
    clips: dict[str, Clip] = field(default_factory=dict)
    wer: dict | None = None

    def as_dict(self) -> dict:
        return {"name": self.name, "levels": [asdict(x) for x in self.levels], "wer": self.wer}


@dataclass(frozen=True)
class Level:
    """One load level: closed loop at `concurrency`, or open loop at `rate` requests/s."""

    concurrency: int = 0
    rate: float | None = None

    def __str__(self) -> str:
        return f"c={self.concurrency}" if self.rate is None else f"{self.rate:g} req/s"


async def run_level(
    target: SpeechTarget, texts: list[str], level: Level, requests: int, keep: dict[str, Clip]
) -> tuple[list[RequestTiming], float]:
    """One level's load; returns the timings and the level's wall time."""
    timings: list[RequestTiming] = []
    bar = tqdm(total=requests, desc=f"{target.name} {level}", unit="req", leave=False)

    async def one(text: str) -> None:
        timing, clip = await target.synthesize(text)
        timings.append(timing)
        if clip is not None and text not in keep:
            keep[text] = clip
        bar.update(1)

    try:
        jobs = (texts[i % len(texts)] for i in range(requests))  # dataset order, wrapping
        if level.rate is None:
            wall = await closed_loop(jobs, level.concurrency, one)
        else:
            wall = await open_loop(jobs, level.rate, one)
    finally:
        bar.close()
    return timings, wall


async def measure_level(
    target: SpeechTarget,
    result: TargetResult,
    texts: list[str],
    level_load: Level,
    requests: int,
    pids: dict[str, int],
) -> None:
    """One level of one target, with the server's own breakdown and the CPU each side used."""
    stats = getattr(target, "stats", None)  # only our server explains its time
    load = os.getloadavg()[0]
    before = await stats() if stats else None
    others = {name: tuple(p for p in pids.values() if p != pid) for name, pid in pids.items()}
    cpu_before = {name: proc_cpu.snapshot(pid, others[name]) for name, pid in pids.items()}
    timings, wall = await run_level(target, texts, level_load, requests, result.clips)
    level = summarize(level_load.concurrency, timings, wall, level_load.rate)
    level.cpu = {
        name: proc_cpu.cores(cpu_before[name], proc_cpu.snapshot(pid, others[name]), wall)
        for name, pid in pids.items()
    }
    after = await stats() if stats else None
    if before is not None and after is not None:
        level.server = server_stats.breakdown(before, after)
    print(report.level_line(target.name, level, load), file=sys.stderr)
    result.levels.append(level)


async def bench(
    targets: list[SpeechTarget],
    texts: list[str],
    levels: list[Level],
    requests: int,
    warmup: int,
    server_pid: int | None = None,
) -> list[TargetResult]:
    """All targets start first; then each level runs on each target in turn (interleaved), so
    a change in what else loads the machine touches every target alike."""
    results = [TargetResult(t.name) for t in targets]
    async with contextlib.AsyncExitStack() as stack:
        for target in targets:
            stack.push_async_callback(target.close)  # first: a start that fails still closes
            await target.start()
            for text in texts[:warmup]:  # first requests pay for lazy loading; not measured
                timing, _ = await target.synthesize(text)
                if timing.error:
                    raise WarmupFailed(f"{target.name}: warm-up request failed: {timing.error}")
        for level in levels:
            for target, result in zip(targets, results, strict=True):
                pids = {"bench": os.getpid()}
                if server_pid is not None and hasattr(target, "stats"):
                    pids["server"] = server_pid
                await measure_level(target, result, texts, level, requests, pids)
    return results


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--concurrency {text!r}: expected integers like 1,2,4,8,16") from None
    if not levels or min(levels) < 1:
        raise UsageError(f"--concurrency {text!r}: expected integers >= 1")
    return levels


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--rate {text!r}: expected request rates like 0.5,1,2") from None
    if not rates or not all(0 < r < float("inf") for r in rates):
        raise UsageError(f"--rate {text!r}: expected rates > 0 (requests per second)")
    return rates


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omni-bench speech",
        description="Load-test a speech endpoint and peers: TTFA, latency, RTF, throughput, WER.",
    )
    p.add_argument("--url", help="our server, e.g. http://127.0.0.1:8000 (omit to run peers only)")
    p.add_argument(
        "--serve",
        action="store_true",
        help="start omni-server on --repo (a free loopback port) as the server under test, "
        "report its CPU, and stop it at the end (instead of --url)",
    )
    p.add_argument(
        "--serve-args",
        default="",
        help="more omni-server arguments for --serve, one shell-quoted string (e.g. "
        '"--max-in-flight 32 --stages.acoustic.scheduler.first_chunk_lane false")',
    )
    p.add_argument("--model", help="model id (default: the first one /v1/models lists)")
    # sent with every request: the server requires a voice, as OpenAI does
    p.add_argument("--voice", default="alloy", help="voice name sent with each request (alloy)")
    p.add_argument(
        "--concurrency",
        default=DEFAULT_CONCURRENCY,
        help=f"closed-loop levels, comma separated (default: {DEFAULT_CONCURRENCY})",
    )
    p.add_argument(
        "--rate",
        help="open loop instead: request rates (requests/s, comma separated; Poisson arrivals, "
        "the same seeded schedule for every target), e.g. 0.5,1,2",
    )
    p.add_argument("--requests", type=int, default=0, help="per level (0: the dataset size)")
    p.add_argument("--dataset", type=Path, default=DEFAULT_DATASET, help="one text per line")
    p.add_argument(
        "--stream",
        action="store_true",
        help='stream_format "audio" (chunked as ready); without it, "stream": false (one body)',
    )
    p.add_argument(
        "--format", default="pcm", choices=FORMATS, help="response_format (default: pcm)"
    )
    p.add_argument("--peer", action="append", default=[], choices=PEERS, help="also measure a peer")
    p.add_argument(
        "--repo",
        type=Path,
        default=Path("repository"),
        help="repository the in-process peer and --serve run (default: repository)",
    )
    p.add_argument("--wer", action="store_true", help="score WER with Whisper tiny.en")
    p.add_argument(
        "--seed", type=int, help="seed every request (ours and in-process): identical audio"
    )
    p.add_argument(
        "--server-pid", type=int, help="our server's pid (local): report its CPU per thread"
    )
    p.add_argument(
        "--warmup", type=int, default=2, help="unmeasured requests before each target (default: 2)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results"),
        help="output folder (default: bench-results)",
    )
    return p


async def run(args: argparse.Namespace) -> dict:
    texts = load_dataset(args.dataset)
    if args.rate is not None:
        if args.concurrency != DEFAULT_CONCURRENCY:
            raise UsageError("--rate (open loop) and --concurrency (closed loop): give one of them")
        levels = [Level(rate=r) for r in parse_rates(args.rate)]
    else:
        levels = [Level(concurrency=c) for c in parse_levels(args.concurrency)]
    requests = args.requests or len(texts)
    if requests < 1:
        raise UsageError("--requests must be >= 1")
    if args.serve and args.url:
        raise UsageError("--serve starts a server, --url names a running one: give one of them")
    if not (args.url or args.serve) and not args.peer:
        raise UsageError("nothing to measure: give --url or --serve, --peer, or both")
    if (args.serve or "in-process" in args.peer) and not (args.repo / "repository.toml").is_file():
        raise UsageError(f"--repo {args.repo}: no repository.toml")
    if args.server_pid is not None and not Path(f"/proc/{args.server_pid}").is_dir():
        raise UsageError(f"--server-pid {args.server_pid}: no such process")
    if args.serve_args and not args.serve:
        raise UsageError("--serve-args needs --serve")
    try:
        serve_args = shlex.split(args.serve_args)
    except ValueError as err:
        raise UsageError(f"--serve-args {args.serve_args!r}: {err}") from None
    if not args.serve:
        return await measure(args, texts, levels, requests, args.url, args.server_pid)
    server = OmniServer(args.repo, serve_args)
    try:
        await server.start()
    except RuntimeError as err:  # it exited or never became ready: its log says why
        raise WarmupFailed(f"--serve: {err}") from None
    try:
        result = await measure(args, texts, levels, requests, server.url, server.pid)
    finally:
        await server.stop()
    if not server.left.clean:  # measured, but the server under test leaks: the run fails
        raise ServerLeftovers(f"--serve: omni-server stopped but {server.left}")
    return result


async def measure(
    args: argparse.Namespace,
    texts: list[str],
    levels: list[Level],
    requests: int,
    url: str | None,
    server_pid: int | None,
) -> dict:
    targets: list[SpeechTarget] = []
    if url:
        targets.append(
            OpenAISpeechTarget(
                url,
                model=args.model,
                voice=args.voice,
                response_format=args.format,
                stream=args.stream,
                seed=args.seed,
            )
        )
    targets += [
        make_peer(
            name, repository=args.repo, max_concurrency=peer_workers(levels),
            response_format=args.format, stream=args.stream, seed=args.seed,
        )
        for name in dict.fromkeys(args.peer)
    ]  # fmt: skip

    warmup = min(args.warmup, len(texts))
    results = await bench(targets, texts, levels, requests, warmup, server_pid)
    if args.wer:
        from omni_bench.wer import Transcriber, evaluate

        transcriber = Transcriber()
        for r in results:
            with tqdm(total=len(r.clips), desc=f"WER {r.name}", unit="clip", leave=False) as bar:
                r.wer = evaluate(r.clips, transcriber, bar).as_dict()
    return {
        "machine": machine() | {"loadavg_at_end": os.getloadavg()},
        "command": " ".join(["omni-bench speech", *args.argv]),
        "settings": {
            "url": url,
            "served_repository": str(args.repo) if args.serve else None,
            "serve_args": args.serve_args if args.serve else None,
            "format": args.format,
            "stream": args.stream,
            "seed": args.seed,
            "concurrency": [x.concurrency for x in levels if x.rate is None],
            "rates": [x.rate for x in levels if x.rate is not None],
            "requests_per_level": requests,
            "dataset": str(args.dataset),
            "dataset_texts": len(texts),
        },
        "targets": [r.as_dict() for r in results],
    }


# an in-process peer under open load gets this many workers (its requests may overlap without
# bound; beyond this they queue inside it, as in a server with that many threads)
OPEN_LOOP_PEER_WORKERS = 64


def peer_workers(levels: list[Level]) -> int:
    return max((x.concurrency for x in levels), default=0) or OPEN_LOOP_PEER_WORKERS


class WarmupFailed(RuntimeError):
    """A target failed before measuring began: nothing to report."""


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        result = asyncio.run(run(args))
    except UsageError as err:
        print(f"omni-bench speech: {err}", file=sys.stderr)
        return 2
    except ConnectionError as err:
        print(f"omni-bench speech: {err}", file=sys.stderr)
        return 2
    except (WarmupFailed, ServerLeftovers) as err:
        print(f"omni-bench speech: {err}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speech.json").write_text(json.dumps(result, indent=2) + "\n")
    table = report.markdown(result)
    (args.out / "speech.md").write_text(table)
    report.write_plots(result, args.out)
    print(table)
    print(f"results in {args.out}/ (speech.json, speech.md, ttfa.png, throughput.png)")
    failed = sum(level["failed"] for t in result["targets"] for level in t["levels"])
    if failed:
        print(f"omni-bench speech: {failed} request(s) failed (see errors in speech.json)")
        return 1
    return 0
