"""The `omni-bench` command line: one subcommand per benchmark.

    omni-bench speech     load test of /v1/audio/speech against peers (omni_bench.speech)
    omni-bench transport  the transport benchmark (omni_bench.transport)
    omni-bench overhead   the runtime overhead benchmark (omni_bench.overhead)
    omni-bench chat       the AR engine against transformers (omni_bench.chat)
    omni-bench cpu-step   the engine's batch-1 CPU decode step vs transformers', profiled
    omni-bench transcribe the transcription endpoint against faster-whisper (omni_bench.transcribe)
    omni-bench realtime   voice-to-voice latency by hop, barge-in (omni_bench.realtime)
    omni-bench soak       requests under SIGKILL / SIGSTOP chaos: recovery, leaks (omni_bench.soak)
    omni-bench ray-serve  Ray Serve path vs direct server, autoscaling (omni_bench.ray_serve)
    omni-bench gpu-mps    two GPU stages on one GPU, MPS off and on (omni_bench.gpu_mps)
    omni-bench gpu-share  replicas' GPU memory and start, sharing off/on (omni_bench.gpu_share)
    omni-bench gpu-tp     the engine's decode at TP=1 and TP=2 over NCCL (omni_bench.gpu_tp)
    omni-bench gpu-handoff  a CUDA tensor between two stage processes (omni_bench.gpu_handoff)
    omni-bench gpu-memory   the engine's KV cache sized from a GPU fraction (omni_bench.gpu_memory)
    omni-bench gpu-step     the engine's decode step vs a static-cache graph and the HBM floor
    omni-bench gpu-moe      Qwen3-Omni's MoE experts: plain loop vs fused Triton vs the HBM floor
    omni-bench reload       a model reload's time to serving and extra memory (omni_bench.reload)
    omni-bench chat-serve   the thinker over HTTP: TTFT and tokens/s by concurrency
    omni-bench omni-serve   Qwen3-Omni over HTTP, text and audio out: TTFT, first audio, RTF

Each subcommand module exposes `main(argv) -> int`; modules load only when their subcommand
runs, so one benchmark's heavy imports never slow another.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

SUBCOMMANDS = {
    "speech": ("omni_bench.speech", "load test of the speech endpoint, with peers and WER"),
    "transport": ("omni_bench.transport", "transport latency and GB/s vs memcpy, pyzmq, SHM"),
    "overhead": ("omni_bench.overhead", "framework overhead of an empty 3-stage pipeline"),
    "chat": ("omni_bench.chat", "AR engine vs transformers generate: TTFT, decode tok/s"),
    "cpu-step": ("omni_bench.cpu_step", "engine batch-1 CPU decode step vs transformers, profile"),
    "transcribe": ("omni_bench.transcribe", "transcription RTF and throughput vs faster-whisper"),
    "realtime": ("omni_bench.realtime", "voice-to-voice latency over /v1/realtime, by hop"),
    "soak": ("omni_bench.soak", "requests under injected process faults: recovery and leaks"),
    "ray-serve": ("omni_bench.ray_serve", "Ray Serve path vs direct: TTFA, throughput, autoscale"),
    "gpu-mps": ("omni_bench.gpu_mps", "two GPU stages on one GPU: MPS off vs on"),
    "gpu-share": ("omni_bench.gpu_share", "GPU memory and start of replicas, sharing off/on"),
    "gpu-tp": ("omni_bench.gpu_tp", "engine decode tok/s at TP=1 vs TP=2 (NCCL)"),
    "gpu-handoff": ("omni_bench.gpu_handoff", "a CUDA tensor from stage to stage, one GPU"),
    "gpu-memory": ("omni_bench.gpu_memory", "KV cache sized from a GPU fraction: the terms, peaks"),
    "gpu-step": ("omni_bench.gpu_step", "engine decode step vs naive static-cache graph, floor"),
    "gpu-moe": ("omni_bench.gpu_moe", "Qwen3-Omni MoE experts: loop vs fused Triton, floor"),
    "reload": ("omni_bench.reload", "model reload: time to serving, memory of both versions"),
    "random-checkpoint": ("omni_bench.random_checkpoint", "random-weight HF checkpoint folders"),
    "higgs-serve": ("omni_bench.higgs_serve", "Higgs Audio v2 served: TTFA, underrun, replicas"),
    "chat-serve": ("omni_bench.chat_serve", "the thinker over HTTP: TTFT, tokens/s by concurrency"),
    "ar-fanout": ("omni_bench.ar_fanout", "an ar stage's chunks across processes, no model"),
    "omni-serve": ("omni_bench.omni_serve", "Qwen3-Omni served: TTFT, first audio, RTF, req/s"),
}


def version() -> str:
    """The installed distribution's version (omni-server ships the benchmarks)."""
    try:
        return importlib.metadata.version("omni-server")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def usage() -> str:
    lines = ["usage: omni-bench {" + ",".join(SUBCOMMANDS) + "} [options]", ""]
    lines += ["       omni-bench --version", ""]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv == ["--version"]:
        print(f"omni-bench {version()}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(
            f"omni-bench: unknown subcommand {name!r}; expected one of {', '.join(SUBCOMMANDS)}",
            file=sys.stderr,
        )
        return 2
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise  # a real missing dependency inside the module must surface
        print(f"omni-bench: the {name} benchmark is not installed ({module_name})", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)
