"""Test repositories for the runtime: small CPU backends, any process topology.

Every backend records where it ran (stage, replica, pid) in the payload it returns, so tests can
check placement and replica binding from the outputs alone, and `values` carries the actual
computation, which must not depend on placement.
"""

from __future__ import annotations

from pathlib import Path

from omni_server.repository.compiler import compile_repository
from omni_server.repository.plan import Plan
from tests.helpers.repo import make_repo

# One file for every test stage: each stage.toml picks its class.
BACKENDS = '''\
import itertools
import os
import time

from omni_server.backend import StageBackend, StageConfigError


STEPS = itertools.count()  # generator steps of this process, in the order they ran


def where(ctx):
    return [ctx.stage, ctx.replica, os.getpid()]


def mark(marker_dir, ctx, request):
    if marker_dir:
        with open(os.path.join(marker_dir, f"{ctx.stage}-{request.id}"), "w") as f:
            f.write(str(ctx.replica))


class Add(StageBackend):
    """values + [k]; fails requests whose inputs name this stage in `fail_at`."""

    def initialize(self, context):
        if "k" not in context.parameters:
            raise StageConfigError(f"parameter k is required, found {sorted(context.parameters)}")
        self.ctx = context
        self.k = context.parameters["k"]

    def execute(self, requests):
        out = []
        for r in requests:
            if r.inputs.get("fail_at") == self.ctx.stage:
                out.append(ValueError(f"asked to fail request {r.id}"))
                continue
            if r.inputs.get("sleep"):
                time.sleep(r.inputs["sleep"])
            out.append({**r.inputs, "values": [*r.inputs["values"], self.k],
                        "trace": [*r.inputs.get("trace", []), where(self.ctx)]})
        return out


class Raise(StageBackend):
    """Raises from execute() itself for requests asking for it (a crash, not an output)."""

    def initialize(self, context):
        self.ctx = context

    def execute(self, requests):
        for r in requests:
            if r.inputs.get("raise_at") == self.ctx.stage:
                raise RuntimeError("backend exploded")
        return [{**r.inputs, "trace": [*r.inputs.get("trace", []), where(self.ctx)]}
                for r in requests]


class Batch(StageBackend):
    """Records the size of the batch each request ran in."""

    def initialize(self, context):
        self.ctx = context

    def execute(self, requests):
        time.sleep(0.02)
        return [{**r.inputs, "batch": len(requests)} for r in requests]


class Split(StageBackend):
    """Routes by inputs["route"]: a stage name or a list of them."""

    def initialize(self, context):
        self.ctx = context

    def execute(self, requests):
        return [dict(r.inputs) for r in requests]

    def route(self, request, outputs):
        return outputs.get("route", ["left", "right"])


class Merge(StageBackend):
    def initialize(self, context):
        self.ctx = context

    def execute(self, requests):
        return [{**r.inputs, "trace": [*r.inputs["trace"], where(self.ctx)]} for r in requests]

    def merge(self, request, inputs):
        names = sorted(inputs)
        return {"values": [v for n in names for v in inputs[n]["values"]],
                "trace": [t for n in names for t in inputs[n]["trace"]],
                "merged": names}


class Speak(StageBackend):
    """Streams n chunks; returns a summary (handed to `next`, or the result when terminal)."""

    def initialize(self, context):
        self.ctx = context
        self.marker_dir = context.parameters.get("marker_dir")

    def generate(self, request):
        n = request.inputs["n"]
        delay = request.inputs.get("delay", 0.0)
        try:
            for i in range(n):
                if request.inputs.get("fail_chunk") == i:
                    raise ValueError(f"chunk {i} failed")
                if delay:
                    time.sleep(delay)
                yield {"i": i, "where": where(self.ctx), "up": request.inputs.get("trace"),
                       "step": next(STEPS)}
        finally:
            mark(self.marker_dir, self.ctx, request)  # evidence that the generator was closed
        return {"n": n, "trace": [*request.inputs.get("trace", []), where(self.ctx)]}


class Voice(StageBackend):
    """A streaming consumer: one output chunk per input chunk (like a vocoder)."""

    def initialize(self, context):
        self.ctx = context
        self.marker_dir = context.parameters.get("marker_dir")

    def generate(self, request):
        count = 0
        try:
            for chunk in request.stream():
                count += 1
                yield {"audio": chunk["i"] * 10, "src": chunk["where"], "up": chunk["up"],
                       "step": chunk["step"], "where": where(self.ctx)}
        finally:
            mark(self.marker_dir, self.ctx, request)
        return {"count": count, "where": where(self.ctx)}


class Tensor(StageBackend):
    """Sends numpy arrays and bytes along (exercises the codec)."""

    def initialize(self, context):
        self.ctx = context

    def execute(self, requests):
        import numpy as np
        out = []
        for r in requests:
            a = np.asarray(r.inputs["array"])
            out.append({"array": a * 2, "blob": bytes(r.inputs.get("blob", b"")) + b"!"})
        return out


class ShardedLinear(StageBackend):
    """y = W x with W's rows split over the TP ranks and the parts all-gathered (gloo)."""

    def initialize(self, context):
        import torch

        weight = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))  # [out, in]
        self.rows = weight.chunk(context.tp_size)[context.tp_rank]  # [out / tp, in]
        self.ctx = context

    def execute(self, requests):
        import torch
        import torch.distributed as dist

        x = torch.tensor([r.inputs["x"] for r in requests], dtype=torch.float32)  # [B, in]
        part = x @ self.rows.T  # [B, out / tp]
        parts = [torch.empty_like(part) for _ in range(self.ctx.tp_size)]
        dist.all_gather(parts, part, group=self.ctx.process_group)
        y = torch.cat(parts, dim=1)  # [B, out]
        return [{**r.inputs, "y": y[i]} for i, r in enumerate(requests)]  # y: a tensor


class ShardedStream(ShardedLinear):
    """The same computation, one chunk per row of x, streamed (mirrors generator steps)."""

    def generate(self, request):
        for row in request.inputs["rows"]:
            (out,) = self.execute([type(request)(id=request.id, inputs={"x": row})])
            yield {"y": out["y"].tolist()}
        return {"rows": len(request.inputs["rows"])}


class CudaMake(StageBackend):
    """A CUDA tensor on this stage's device: i * arange(n)."""

    def initialize(self, context):
        self.device = context.device

    def execute(self, requests):
        import torch

        return [{"t": torch.arange(r.inputs["n"], device=self.device, dtype=torch.float32)
                 * r.inputs["i"], "i": r.inputs["i"]} for r in requests]


class CudaCheck(StageBackend):
    """Reports where its input tensor arrived and how it crossed."""

    def initialize(self, context):
        self.device = context.device

    def execute(self, requests):
        from omni_server.runtime import cuda

        return [{"device": str(r.inputs["t"].device), "sum": float(r.inputs["t"].sum()),
                 "t": r.inputs["t"] * 2, "ipc_received": cuda.stats["ipc_received"]}
                for r in requests]


class Broken(StageBackend):
    """Breaks the execute() contract the way inputs["how"] says."""

    def execute(self, requests):
        how = requests[0].inputs["how"]
        if how == "short":
            return []
        if how == "not-a-dict":
            return ["text" for _ in requests]
        return [dict(r.inputs) for r in requests]
'''


def _stage(cls: str, extra: str = "", process: str | None = None) -> str:
    lines = [f'backend = "model.py:{cls}"']
    if process:
        lines.append(f'process = "{process}"')
    return "\n".join(lines) + "\n" + extra


def build(root: Path, stages: dict[str, str], models: str, processes: str = "") -> Plan:
    make_repo(root, stages, models + "\n" + processes, {name: BACKENDS for name in stages})
    return compile_repository(root)


def chain(root: Path, layout: str) -> Plan:
    """a -> b -> c (terminal), each Add; layout: 'one' process, 'split', or 'replicated'."""
    proc = {"one": ("p", "p", "p"), "split": ("a", "b", "c"), "replicated": ("a", "bc", "bc")}
    pa, pb, pc = proc[layout]
    stages = {
        "a": _stage("Add", 'next = "b"\n[parameters]\nk = 1\n', pa),
        "b": _stage("Add", 'next = "c"\n[parameters]\nk = 2\n', pb),
        "c": _stage("Add", "terminal = true\n[parameters]\nk = 3\n", pc),
    }
    processes = ""
    if layout == "replicated":
        processes = "[processes.a]\nnum_replicas = 2\n[processes.bc]\nnum_replicas = 3\n"
    return build(root, stages, '[models.m]\nentry = "a"\ntasks = ["speech"]\n', processes)


def stream(
    root: Path,
    layout: str,
    marker_dir: Path | None = None,
    front: int = 1,
    back: int = 1,
    binding: str | None = None,
):
    """[a ->] speak --stream_to + next--> voice (terminal); layout 'one', 'split' or 'replicated'
    (a in process front, speak + voice in process back, with `front` / `back` replicas, bound
    by `binding` when given)."""
    params = f'[parameters]\nmarker_dir = "{marker_dir}"\nk = 0\n' if marker_dir else ""
    procs = {"one": ("p", "p"), "split": ("speak", "voice"), "replicated": ("back", "back")}
    speak_proc, voice_proc = procs[layout]
    stream = '[scheduler]\nkind = "stream"\n'
    stages = {
        "speak": _stage(
            "Speak", 'next = "voice"\nstream_to = "voice"\n' + stream + params, speak_proc
        ),
        "voice": _stage("Voice", "terminal = true\n" + stream + params, voice_proc),
    }
    entry = "speak"
    processes = ""
    if layout == "replicated":
        stages["a"] = _stage("Add", 'next = "speak"\n[parameters]\nk = 1\n', "front")
        entry = "a"
        processes = (
            f"[processes.front]\nnum_replicas = {front}\n[processes.back]\nnum_replicas = {back}\n"
        )
        if binding is not None:
            processes += f'binding = "{binding}"\n'  # [processes.back] is the last table
    return build(root, stages, f'[models.m]\nentry = "{entry}"\ntasks = ["speech"]\n', processes)
