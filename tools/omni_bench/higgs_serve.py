"""`omni-bench higgs-serve`: the Higgs Audio v2 pipeline (examples/higgs-audio-v2) served over
HTTP and loaded with `omni-bench speech`, one replica of `pipeline` against several.

    omni-bench higgs-serve --checkpoint DIR [--size full] [--gpu] [--concurrency 1,4,16,64]
        [--rate 5,10,20 [--duration 20]] [--replicas 1,3,3v] [--audio-seconds 6] [--out DIR]

The whole device run of issue 22's "Measure" in one command. A random checkpoint is written
to DIR first when DIR has none (`random-checkpoint`, drawn on the GPU with --gpu). For each
replica count, one server is started (`omni-server --repo examples/higgs-audio-v2
--parameters.checkpoint DIR`; with --gpu on the GPU as the example places itself there, its
`device = "auto"` stages held to it: bf16, cuda:0, CUDA graphs, the vocoder and the audio
encoder on the GPU, MPS where it starts (`mps = "auto"`); without, on the CPU. More than one
replica: the `pipeline` process repeated on cuda:0 under MPS with its weights shared, each
engine with its share of the example's fraction; `3v`: the vocoder
stage moved into `pipeline`, so each replica decodes its own frames, handed over in-process;
`1m`: one replica with `mps = "on"`; `1e`: the vocoder without its CUDA graphs; `1f4`: the
first chunk with 4 lookahead columns; flags combine, `1mf4`)
and each concurrency level is a closed-loop `omni-bench speech` run against it (streamed pcm, the
dataset's texts of one to three sentences, every request `--audio-seconds` of audio: random
weights have no end of speech worth waiting for). With --rate, each server then takes
open-loop levels too: requests arrive at each rate (Poisson arrivals, the same seeded schedule
at every rate and layout: `omni-bench speech --rate`) for --duration seconds, whether or not
earlier ones have ended, as a service's users send them (`--concurrency ""`: open loop
only). Per level: TTFA p50/p95, RTF, audio seconds per second, requests per second, the share
of streams that underrun (a listener who starts at the first byte runs out of audio); per
server: the GPU's memory in use (nvidia-smi, peak while loaded). Tables to stdout and
`OUT/higgs_serve.md`, everything in `OUT/higgs_serve.json` (each level's speech.json beside it;
each server's log in `OUT/server-rN.log`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from pathlib import Path
from typing import Any, NamedTuple

from omni_bench import speech
from omni_bench.harness import tables
from omni_bench.harness.gpu import GpuMemory
from omni_bench.harness.served_args import add_served_options
from omni_bench.harness.server import OmniServer
from omni_server.compiler import DeviceRequest, MachineFacts, compile_repository

# the example repository, relative to where the bench runs (a source checkout), as --repo
# defaults elsewhere: an installed omni_bench has no examples/ beside it
REPO = Path("examples/higgs-audio-v2")


class Layout(NamedTuple):
    replicas: int  # of `pipeline`
    vocoders: bool  # v: the vocoder stage inside `pipeline` (one CUDA context a replica)
    mps: bool  # m: MPS on (always with more than one replica)
    eager: bool  # e: the vocoder without its CUDA graphs (the peer of the graphs)
    first_lookahead: int | None  # f<N>: the vocoder's first_lookahead_frames


def parse_layout(text: str) -> Layout:
    """ "3" -> three `pipeline` replicas and one `vocoder` process; "3v" -> three replicas of
    `pipeline` with the vocoder stage in each ("1v": one); "1m": one replica under MPS; "1e":
    the vocoder decoding eagerly; "1f4": the first chunk decoded with 4 lookahead columns."""
    match = re.fullmatch(r"(\d+)([vme]*)(?:f(\d+))?", text)
    if match is None or int(match[1]) < 1 or len(set(match[2])) != len(match[2]):
        raise ValueError(text)
    flags, replicas = match[2], int(match[1])
    first = None if match[3] is None else int(match[3])
    return Layout(replicas, "v" in flags, "m" in flags or replicas > 1, "e" in flags, first)


def placement_overrides(repo: Path, gpu: bool, replicas: int) -> list[str]:
    """The example's own placement, held to the machine the run asks for: its `device =
    "auto"` stages on the GPU (`--gpu`: a machine without one fails the start instead of
    running on the CPU) or on the CPU. With replicas sharing the GPU, each engine replica gets
    its share of the example's engine fraction; everything else is the example's [on_gpu]
    (bf16, the KV tokens, the fractions, MPS)."""
    plan = compile_repository(repo, machine=MachineFacts(gpus=1))  # as on a GPU machine
    device = "gpu" if gpu else "cpu"
    out = []
    for stage in plan.stages.values():
        if stage.device is DeviceRequest.AUTO:
            out += [f"--stages.{stage.name}.device", device]
    engine = plan.stages["tts_engine"].gpu_memory_fraction
    if gpu and replicas > 1 and engine is not None:
        out += ["--stages.tts_engine.gpu_memory_fraction", f"{engine / replicas:.3f}"]
    return out


def serve_args(args: argparse.Namespace, text: str) -> list[str]:
    layout = parse_layout(text)
    replicas, vocoders = layout.replicas, layout.vocoders
    out = [
        "--parameters.checkpoint", str(args.checkpoint),
        "--stages.tts_engine.parameters.ignore_eos", "true",
        "--stages.tts_engine.parameters.max_audio_seconds", str(args.audio_seconds),
        "--max-in-flight", str(max_in_flight(args)),
    ]  # fmt: skip
    out += placement_overrides(args.repo, args.gpu, replicas)
    if replicas > 1:
        out += [
            "--processes.pipeline.num_replicas", str(replicas),
            "--server.weight_share", "on",
        ]  # fmt: skip
        if args.gpu:
            devices = json.dumps([0] * replicas, separators=(",", ":"))
            out += ["--processes.pipeline.replica_devices", devices]
    if args.kv_tokens is not None:
        out += ["--stages.tts_engine.engine.max_total_tokens", str(args.kv_tokens)]
    if vocoders:
        # not a replicated `vocoder` process: weight sharing makes every process replicated on
        # one GPU a sharing group, which needs an engine stage (compiler/placement.py)
        out += ["--stages.vocoder.process", "pipeline", "--stages.word_timing.process", "pipeline"]
    if args.gpu and layout.mps:
        out += ["--server.mps", "on"]  # the example's "auto" would fall back without MPS
    if layout.eager:
        out += ["--stages.vocoder.parameters.cuda_graphs", "false"]
    if layout.first_lookahead is not None:
        out += ["--stages.vocoder.parameters.first_lookahead_frames", str(layout.first_lookahead)]
    return out + args.extra


def open_loop_requests(args: argparse.Namespace, rate: float) -> int:
    """Requests sent at one open-loop rate: --duration seconds of arrivals, at least
    --min-requests."""
    return max(args.min_requests, round(rate * args.duration))


def max_in_flight(args: argparse.Namespace) -> int:
    """The server's admission limit: above any level's load, so the bench measures queueing
    inside the server rather than its 429s (an open loop may have every request in flight)."""
    closed = 2 * max(args.levels, default=0)
    return max(64, closed, *(open_loop_requests(args, r) for r in args.rates))


def _level(args: argparse.Namespace, url: str, load: speech.Level, out: Path) -> dict[str, Any]:
    """One closed-loop (`load.concurrency`) or open-loop (`load.rate`) level of `speech`."""
    if load.rate is None:
        requests = max(args.min_requests, args.rounds * load.concurrency)
        shape = ["--concurrency", str(load.concurrency)]
        warmup = min(load.concurrency, 4)
    else:
        requests = open_loop_requests(args, load.rate)
        shape, warmup = ["--rate", f"{load.rate:g}"], 4
    argv = [
        "--url", url, "--stream", "--format", "pcm", "--voice", args.voice, *shape,
        "--requests", str(requests), "--dataset", str(args.dataset),
        "--warmup", str(warmup), "--out", str(out),
    ]  # fmt: skip
    rc = speech.main(argv)
    result = json.loads((out / "speech.json").read_text())
    level = result["targets"][0]["levels"][0]
    level["exit_code"] = rc
    return level


def _serve(args: argparse.Namespace, replicas: str) -> dict[str, Any]:
    args.out.mkdir(parents=True, exist_ok=True)
    server = OmniServer(
        args.repo,
        serve_args(args, replicas),
        ready_timeout_s=args.ready_timeout,
        log=args.out / f"server-r{replicas}.log",
    )
    gpu = GpuMemory()
    with gpu:
        asyncio.run(server.start())
        try:
            loaded = gpu.now()
            levels = [
                _level(
                    args, server.url, speech.Level(concurrency=c), args.out / f"r{replicas}-c{c}"
                )
                for c in args.levels
            ]
            levels += [
                _level(args, server.url, speech.Level(rate=r), args.out / f"r{replicas}-rate{r:g}")
                for r in args.rates
            ]
            log = server.log_tail(1 << 20).splitlines()
        finally:
            asyncio.run(server.stop())
    return {
        "replicas": replicas,
        "serve_args": serve_args(args, replicas),
        "gpu_mib_loaded": loaded,
        "gpu_mib_peak": gpu.peak,
        "leftovers": str(server.left) if not server.left.clean else "",
        # the vocoder's own lines (graphs captured, decoder calls and their cost)
        "vocoder_log": [line for line in log if "vocoder:" in line][-6:],
        "levels": levels,
    }


def _ms(d: dict[str, float], key: str) -> str:
    v = d.get(key)
    return "" if v is None else f"{v * 1000:.0f}"


def report(runs: list[dict[str, Any]]) -> str:
    """The closed-loop table, the open-loop table (when run), then one row per layout."""
    closed = [(run, lv) for run in runs for lv in run["levels"] if lv.get("rate") is None]
    open_ = [(run, lv) for run in runs for lv in run["levels"] if lv.get("rate") is not None]
    lines = []
    if closed:
        columns = [
            "replicas", "concurrency", "requests", "failed", "TTFA p50 ms", "TTFA p95 ms",
            "RTF p50", "audio s/s", "req/s", "underrun share", "worst deficit s",
        ]  # fmt: skip
        lines += tables.header(columns)
        for run, lv in closed:
            lines.append(tables.row([run["replicas"], lv["concurrency"], *_measures(lv)]))
        lines.append("")
    if open_:
        columns = [
            "replicas", "rate req/s", "requests", "failed", "TTFA p50 ms", "TTFA p95 ms",
            "RTF p50", "audio s/s", "req/s", "underrun share", "worst deficit s",
        ]  # fmt: skip
        lines += tables.header(columns)
        for run, lv in open_:
            lines.append(tables.row([run["replicas"], f"{lv['rate']:g}", *_measures(lv)]))
        lines.append("")
    lines += tables.header(["replicas", "best audio s/s", "vs one", "GPU MiB loaded", "peak"])
    base = None
    for run in runs:
        best = max(lv["audio_seconds_per_second"] for lv in run["levels"])
        base = base or best
        lines.append(
            tables.row(
                [
                    run["replicas"], f"{best:.1f}", f"{best / base:.2f}x",
                    run["gpu_mib_loaded"], run["gpu_mib_peak"],
                ]
            )
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def _measures(lv: dict[str, Any]) -> list[Any]:
    return [
        lv["requests"], lv["failed"], _ms(lv["ttfa"], "p50"), _ms(lv["ttfa"], "p95"),
        f"{lv['rtf'].get('p50', float('nan')):.3f}", f"{lv['audio_seconds_per_second']:.1f}",
        f"{lv['requests_per_second']:.2f}", f"{lv['underrun_share']:.2f}",
        f"{lv['worst_deficit']:.3f}",
    ]  # fmt: skip


def parse_rates(text: str) -> list[float]:
    """--rate: "" (none) or request rates > 0, comma separated."""
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected rates like 5,10,20") from None
    if not all(0 < r < float("inf") for r in rates):
        raise argparse.ArgumentTypeError(f"{text!r}: expected rates > 0 (requests/s)")
    return rates


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omni-bench higgs-serve", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--repo", type=Path, default=REPO, help=f"the Higgs repository ({REPO})")
    p.add_argument("--checkpoint", type=Path, required=True, help="folder (written if empty)")
    p.add_argument("--size", choices=("tiny", "full"), default="full", help="when written")
    p.add_argument(
        "--gpu",
        action="store_true",
        help="on the GPU, as the example places itself there (default: on the CPU)",
    )
    p.add_argument("--concurrency", default="1,4,16,64", help='closed-loop levels ("": none)')
    p.add_argument(
        "--rate",
        dest="rates",
        type=parse_rates,
        default="",
        help="open-loop levels after the closed-loop ones: request rates (requests/s, Poisson "
        "arrivals, seeded), e.g. 5,10,20 (default: none)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=20.0,
        help="open loop: seconds of arrivals at each rate (20; at least --min-requests)",
    )
    p.add_argument(
        "--replicas",
        default="1,3",
        help="layouts: replica counts of `pipeline`, each with flags: v the vocoder in each "
        "replica, m MPS on, e the vocoder eager, f<N> first_lookahead_frames N (1,3)",
    )
    p.add_argument("--audio-seconds", type=float, default=6.0, help="audio per request (6)")
    p.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help="pinned KV tokens a replica (default: the example's, 65536 on a GPU)",
    )
    p.add_argument("--voice", default="higgs")
    p.add_argument("--dataset", type=Path, default=speech.DEFAULT_DATASET)
    add_served_options(p, "higgs-serve", 400.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
        counts = args.replicas.split(",")
        for layout in counts:
            parse_layout(layout)
        if min(args.levels, default=1) < 1:
            raise ValueError(args.levels)
        if not (args.levels or args.rates) or not args.duration > 0:
            raise ValueError("no level")
    except ValueError:
        print(
            "omni-bench higgs-serve: --concurrency: integers >= 1 (or --rate: not both "
            "empty); --duration: seconds > 0; --replicas: layouts (a count, then "
            "flags from v, m, e and f<N>); lists comma separated",
            file=sys.stderr,
        )
        return 2
    if not (args.checkpoint / "config.json").is_file():
        from omni_bench import random_checkpoint

        draw = ["--draw-on", "cuda"] if args.gpu else []
        random_checkpoint.main(
            ["higgs-audio-v2", "--size", args.size, "--out", str(args.checkpoint), *draw]
        )
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"# higgs-serve: {args.checkpoint}, gpu={args.gpu}", flush=True)
    runs = []
    for replicas in counts:
        runs.append(_serve(args, replicas))
        print(f"# {replicas} replica(s) done", flush=True)
        (args.out / "higgs_serve.json").write_text(json.dumps(runs, indent=2) + "\n")
    table = report(runs)
    (args.out / "higgs_serve.md").write_text(table)
    print(table)
    failed = sum(lv["failed"] for run in runs for lv in run["levels"])
    return 1 if failed or any(run["leftovers"] for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
