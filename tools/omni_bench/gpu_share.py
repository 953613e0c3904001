"""Replicas of an engine stage on one GPU, weight sharing off against on (a GPU machine).

    omni-bench gpu-share [--replicas 1,2,4] [--shape llama-1b] [--kv-tokens 16384]
                         [--fraction 0.2] [--gpu 0]

One engine stage (random bf16 weights of `--shape`, drawn on the GPU; `--kv-tokens` of KV cache
pinned per replica, CUDA graphs off) in a process with N replicas on `cuda:GPU`, with
`weight_share` off and on (N = 1: off only, there is nothing to share). Per row: the start time
of the runtime (spawn to every replica ready: with sharing the followers start after the
leader), the GPU memory the run added (nvidia-smi's device total before start and once ready),
what nvidia-smi attributes to each stage process (where it can see them), the weights and KV
bytes of one replica, and whether every replica gave the same greedy tokens. Sharing should
cost one copy of the weights plus N KV budgets (and N CUDA contexts); without it, N copies.

`--cpu`: the same on the CPU with a small shape (a smoke run of the tool; memory is then the
stage processes' proportional set size, PSS, where shared pages count once in all).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from omni_bench.harness import tables
from omni_server.backend import Request, StageBackend, StageContext
from omni_server.compiler import Plan, compile_repository
from omni_server.gpu import discover
from omni_server.pipeline import Runtime

_STAGE_FILE = """
from omni_bench.gpu_share import ShareProbe  # noqa: F401
"""

PROMPT = [11, 250, 3071, 9, 42, 7, 1000, 5]
TINY = "tiny"  # the --cpu shape


class ShareProbe(StageBackend):
    """The engine on random weights taken through `context.shared_weights`."""

    def initialize(self, context: StageContext) -> None:
        import torch

        from omni_server.engine import SHAPES, Engine, EngineConfig, LlamaShape

        self.ctx = context
        name = str(context.parameters["shape"])
        shape = (
            LlamaShape(
                vocab_size=4096,
                hidden_size=256,
                intermediate_size=1024,
                num_layers=4,
                num_heads=8,
                num_kv_heads=2,
                head_dim=32,
                rope_theta=10000.0,
                rms_norm_eps=1e-5,
                max_position_embeddings=1024,
            )
            if name == TINY
            else SHAPES[name]
        )
        table: dict[str, Any] = {**context.engine, "device": context.device}
        if context.gpu_memory_fraction is not None:
            table["gpu_memory_fraction"] = context.gpu_memory_fraction
        config = EngineConfig.from_table(table)
        self.on_gpu = context.device.startswith("cuda")
        started = time.perf_counter()
        self.engine = Engine.from_random(shape, config, seed=0, weights=context.shared_weights)
        if self.on_gpu:
            torch.cuda.synchronize()
        self.engine_s = time.perf_counter() - started
        self.weight_bytes = sum(
            p.numel() * p.element_size() for p in self.engine.model.parameters()
        )
        self.kv_bytes = sum(
            t.numel() * t.element_size() for t in [*self.engine.cache.k, *self.engine.cache.v]
        )

    def execute(self, requests: list[Request]) -> list[dict[str, Any]]:
        import torch

        from omni_server.engine import GenerationRequest, SamplingParams

        out = []
        for i, _ in enumerate(requests):
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            events = self.engine.generate([GenerationRequest(f"g{i}", PROMPT, params)])
            out.append(
                {
                    "replica": self.ctx.replica,
                    "pid": os.getpid(),
                    "tokens": [t for e in events[f"g{i}"] for t in e.token_ids],
                    "engine_s": self.engine_s,
                    "weight_bytes": self.weight_bytes,
                    "kv_bytes": self.kv_bytes,
                    "allocated": torch.cuda.memory_allocated() if self.on_gpu else 0,
                }
            )
        return out


def _plan(root: Path, args: argparse.Namespace, replicas: int, share: str) -> Plan:
    folder = root / "lm"
    folder.mkdir(parents=True)
    (folder / "model.py").write_text(_STAGE_FILE)
    placement = "" if args.cpu else f"gpu = [{args.gpu}]\ngpu_memory_fraction = {args.fraction}\n"
    shape = TINY if args.cpu else args.shape
    dtype = "float32" if args.cpu else "bfloat16"
    (folder / "stage.toml").write_text(
        'backend = "model.py:ShareProbe"\nprocess = "lm"\nterminal = true\n'
        + placement
        + f'[engine]\nmax_total_tokens = {args.kv_tokens}\ndtype = "{dtype}"\n'
        + "cuda_graphs = false\nmax_seq_len = 1024\n"
        + f'[parameters]\nshape = "{shape}"\n'
    )
    devices = "" if args.cpu else f"replica_devices = {[args.gpu] * replicas}\n"
    (root / "repository.toml").write_text(
        f'[server]\nweight_share = "{share}"\n'
        '[models.m]\nentry = "lm"\ntasks = ["chat"]\n'
        f"[processes.lm]\nnum_replicas = {replicas}\n{devices}"
    )
    return compile_repository(root)


def _gpu_used_mib(gpu: int) -> float:
    out = subprocess.run(
        ["nvidia-smi", "-i", str(gpu), "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(out.strip().splitlines()[0])


def _per_process_mib(pids: list[int]) -> dict[int, float]:
    """nvidia-smi's memory per compute process (empty where it cannot see our pids)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    found = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and int(pid) in pids:
            found[int(pid)] = float(mib)
    return found


def _pss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1])
    return total / 1024


async def _row(args: argparse.Namespace, replicas: int, share: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="omni-bench-share-") as tmp:
        plan = _plan(Path(tmp), args, replicas, share)
        before = 0.0 if args.cpu else _gpu_used_mib(args.gpu)
        runtime = Runtime(plan, start_timeout=args.start_timeout)
        started = time.perf_counter()
        await runtime.start()
        start_s = time.perf_counter() - started
        try:
            model = plan.models["m"]
            outputs = await asyncio.gather(
                *(runtime.submit(model, {}).result() for _ in range(replicas))
            )
            pids = list(runtime.processes().values())
            if args.cpu:
                used, per_process = _pss_mib(pids), {}
            else:
                used, per_process = _gpu_used_mib(args.gpu) - before, _per_process_mib(pids)
        finally:
            await runtime.stop()
    assert {o["replica"] for o in outputs} == set(range(replicas)), "round robin missed one"
    return {
        "start_s": start_s,
        "used": used,
        "per_process": sorted(per_process.values(), reverse=True),
        "weights": outputs[0]["weight_bytes"] / 2**20,
        "kv": outputs[0]["kv_bytes"] / 2**20,
        "engine_s": max(o["engine_s"] for o in outputs),
        "same": len({tuple(o["tokens"]) for o in outputs}) == 1,
    }


async def run(args: argparse.Namespace) -> None:
    counts = [int(n) for n in args.replicas.split(",")]
    where = "the CPU (PSS of the stage processes)" if args.cpu else f"cuda:{args.gpu}"
    shape = TINY if args.cpu else args.shape
    print(
        f"# gpu-share: {shape} on {where}, {args.kv_tokens} KV tokens per replica, "
        f"fraction {args.fraction} per replica"
    )
    columns = ["sharing", "replicas", "start s", "slowest engine build s", "memory added MiB"]
    columns += ["per process MiB (nvidia-smi)", "weights MiB", "KV MiB / replica", "same tokens"]
    print("\n".join(tables.header(columns, "lrrrrlrrl")))
    used: dict[tuple[str, int], float] = {}
    for n in counts:
        for share in ("off", "on") if n > 1 else ("off",):
            r = await _row(args, n, share)
            used[(share, n)] = r["used"]
            per = ", ".join(f"{m:.0f}" for m in r["per_process"]) or "-"
            times = [f"{r['start_s']:.1f}", f"{r['engine_s']:.1f}", f"{r['used']:.0f}", per]
            sizes = [f"{r['weights']:.0f}", f"{r['kv']:.0f}", "yes" if r["same"] else "NO"]
            print(tables.row([share, n, *times, *sizes]), flush=True)
    for n in counts:
        if ("on", n) in used:
            saved = used[("off", n)] - used[("on", n)]
            print(f"# {n} replicas: sharing saved {saved:.0f} MiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="omni-bench gpu-share", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--replicas", default="1,2,4", help="replica counts (1,2,4)")
    parser.add_argument("--shape", default="llama-1b", help="engine shape (llama-1b: 1.2B)")
    parser.add_argument("--kv-tokens", type=int, default=16384, help="KV per replica (16384)")
    parser.add_argument("--fraction", type=float, default=0.2, help="memory per replica (0.2)")
    parser.add_argument("--gpu", type=int, default=0, help="the GPU (0)")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds (300)")
    parser.add_argument("--cpu", action="store_true", help="a smoke run on the CPU, no GPU")
    args = parser.parse_args(argv)
    if not args.cpu:
        machine = discover(os.environ)  # as the runtime does: no CUDA context in this process
        if machine.gpu(args.gpu) is None:
            print(
                f"omni-bench gpu-share: needs cuda:{args.gpu} ({machine.why_no_gpu})",
                file=sys.stderr,
            )
            return 2
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
