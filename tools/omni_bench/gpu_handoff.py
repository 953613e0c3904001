"""A CUDA tensor handed from one stage process to the next on the same GPU, through the runtime
at its default settings (a GPU machine).

    omni-bench gpu-handoff [--requests 300] [--warmup 30] [--sizes-mib 1,64] [--compare]

Two stages on `cuda:0`, `make -> take`, each in its own process (and, for comparison, both in
one process, where the tensor object is passed as it is). `make` fills a fresh tensor, waits for
the GPU, stamps the clock and returns it; `take` stamps the clock when its backend is called
(the tensor is usable: work it queues runs after the copy out of the sender's block) and again
once its stream has finished that copy. A tiny CPU payload over the same hop gives the runtime's
own cost of a stage-to-stage hop, so the difference is what the tensor adds. One request at a
time, after warm-up; microseconds (same-host monotonic clock).

The crossing alone is measured too, as the runtime makes it: two processes, each with the
runtime's `Endpoint` at its defaults (rings, the event-loop receiver sleeping on the doorbell,
the CUDA lane): from the sender's `send_data` to the receiver's loop holding the decoded,
usable tensor; inside it, the sender's encode (until `send_data` returns) and the receiver's
side (the rest: the ring, the receiver's wake-up, its decode).

`--compare` measures only the crossing, the one-tensor fast path (a C-encoded record, the
pool's block handed on as a view, the hot-stream spin) against the path before it (pickle, a
clone, the doorbell wake-up: OMNI_CUDA_PACKED=0 OMNI_RING_HOT_SPIN_US=0), interleaved in one
run: `--rounds` alternations of `--requests` crossings each, per size.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from omni_bench.harness import tables
from omni_bench.harness.timing import percentile
from omni_server.backend import Request, StageBackend, StageContext
from omni_server.compiler import compile_repository
from omni_server.pipeline import Runtime
from omni_server.wire import Endpoint

_STAGE_FILE = """
from omni_bench.gpu_handoff import Make, Take  # noqa: F401
"""


class Make(StageBackend):
    def initialize(self, context: StageContext) -> None:
        self.device = context.device

    def execute(self, requests: list[Request]) -> list[dict[str, Any]]:
        import torch

        out = []
        for r in requests:
            nbytes = r.inputs["nbytes"]
            payload: dict[str, Any] = {}
            if nbytes:
                t = torch.empty(nbytes // 4, dtype=torch.float32, device=self.device)
                t.fill_(float(r.inputs["i"]))
                payload["t"] = t
            torch.cuda.synchronize(self.device)
            payload["sent"] = time.perf_counter()
            out.append(payload)
        return out


class Take(StageBackend):
    def initialize(self, context: StageContext) -> None:
        self.device = context.device

    def execute(self, requests: list[Request]) -> list[dict[str, Any]]:
        import torch

        now = time.perf_counter()
        out = []
        for r in requests:
            t = r.inputs.get("t")
            if t is not None:
                torch.cuda.current_stream(self.device).synchronize()
            ready = time.perf_counter()
            out.append({"received": now - r.inputs["sent"], "ready": ready - r.inputs["sent"]})
        return out


def _repository(root: Path, same_process: bool) -> Any:
    for name, cls, wire in (("make", "Make", 'next = "take"'), ("take", "Take", "terminal = true")):
        folder = root / name
        folder.mkdir(parents=True)
        process = "gpu" if same_process else name
        (folder / "stage.toml").write_text(
            f'backend = "model.py:{cls}"\nprocess = "{process}"\n{wire}\ngpu = 0\n'
            "gpu_memory_fraction = 0.1\n"
        )
        (folder / "model.py").write_text(_STAGE_FILE)
    (root / "repository.toml").write_text('[models.h]\nentry = "make"\ntasks = ["speech"]\n')
    return compile_repository(root)


async def _measure(same_process: bool, nbytes: int, requests: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        plan = _repository(Path(tmp), same_process)
        runtime = Runtime(plan)
        await runtime.start()
        try:
            model = plan.models["h"]
            received, ready = [], []
            for i in range(warmup + requests):
                result = await runtime.submit(model, {"nbytes": nbytes, "i": i}).result()
                if i >= warmup:
                    received.append(result["received"] * 1e6)
                    ready.append(result["ready"] * 1e6)
        finally:
            await runtime.stop()
    return {"received": received, "ready": ready}


def _endpoint(run_dir: Path, name: str, peer: str) -> Endpoint:
    endpoint = Endpoint(run_dir, "hb", name, 8 << 20, {peer: frozenset({0})})
    endpoint.create_inbound([peer])
    return endpoint


async def _cross_receiver(run_dir: str, ready: Any, profile: bool) -> None:
    import cProfile
    import pstats

    import torch

    torch.cuda.set_device(0)
    # profiled: the receiver's whole loop while crossings arrive (its wake-ups and decodes)
    profiler = cProfile.Profile() if profile else None
    endpoint = _endpoint(Path(run_dir), "b", "a")
    done = asyncio.Event()

    def handle(message: Any) -> None:
        if message.get("stop"):
            done.set()
            return
        endpoint.send_data("a", {"arrived": time.perf_counter(), "ok": message["t"].is_cuda})

    endpoint.start_receiving(handle, lambda _: done.set())
    ready.set()
    if profiler is not None:
        profiler.enable()
    await done.wait()
    if profiler is not None:
        profiler.disable()
    ring = endpoint._inbound["a"]
    if hasattr(ring, "typical_wait_us"):  # what the adaptive poll learnt (trees since 12-02)
        print(f"NOTE receiver's ring: typical wait {ring.typical_wait_us:.0f} us, "
              f"poll bound {ring.hot_poll_us:.0f} us", flush=True)  # fmt: skip
    await endpoint.close()
    if profiler is not None:
        print("== receiver: its loop (ring wake-ups, decode)", flush=True)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


def _run_receiver(run_dir: str, ready: Any, profile: bool) -> None:
    asyncio.run(_cross_receiver(run_dir, ready, profile))


async def _cross(
    nbytes: int, requests: int, warmup: int, profile: bool = False
) -> dict[str, list[float]]:
    import cProfile
    import pstats

    import torch

    profiler = cProfile.Profile() if profile else None

    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as run_dir:
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        endpoint = _endpoint(Path(run_dir), "a", "b")
        child = ctx.Process(target=_run_receiver, args=(run_dir, ready, profile), daemon=True)
        child.start()
        replies: asyncio.Queue[Any] = asyncio.Queue()
        endpoint.start_receiving(replies.put_nowait, lambda exc: replies.put_nowait(exc))
        out: dict[str, list[float]] = {"crossing": [], "encode": [], "receiver": []}
        out.update(export=[], push=[])  # the encode's two parts: export (codec, lane, pool), push
        pushed = [0.0]
        try:
            if not await asyncio.to_thread(ready.wait, 120):
                raise RuntimeError("the receiving process did not start")
            for i in range(warmup + requests):
                t = torch.full((nbytes // 4,), float(i), device="cuda")
                torch.cuda.synchronize()
                sent = time.perf_counter()
                if profiler is not None:
                    profiler.enable()
                endpoint.send_data("b", {"t": t})
                encoded = time.perf_counter()
                if profiler is not None:
                    profiler.disable()
                if i == 0:  # the outlet exists now: stamp where the encode meets the ring
                    _stamp_pushes(endpoint, "b", pushed)
                reply = await asyncio.wait_for(replies.get(), 60)
                if isinstance(reply, BaseException) or not reply["ok"]:
                    raise RuntimeError(f"crossing failed: {reply!r}")
                if i >= warmup:
                    out["crossing"].append((reply["arrived"] - sent) * 1e6)
                    out["encode"].append((encoded - sent) * 1e6)
                    out["receiver"].append((reply["arrived"] - encoded) * 1e6)
                    out["export"].append((pushed[0] - sent) * 1e6)
                    out["push"].append((encoded - pushed[0]) * 1e6)
                del t
            endpoint.send_data("b", {"stop": True})
            await asyncio.to_thread(child.join, 30)
        finally:
            if child.is_alive():
                child.kill()
                child.join()
            await endpoint.close()
    if profiler is not None:
        print("== sender: send_data", flush=True)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    return out


def _stamp_pushes(endpoint: Endpoint, receiver: str, pushed: list[float]) -> None:
    """Makes the outlet's ring stamp pushed[0] as its push begins (one clock read added)."""
    ring = endpoint._outlets[receiver]._ring
    push = ring.push

    def stamped(*args: Any, **kwargs: Any) -> None:
        pushed[0] = time.perf_counter()
        push(*args, **kwargs)

    ring.push = stamped  # type: ignore[method-assign]


# the crossing before the one-tensor fast path: pickle + clone, doorbell wake-ups
_BEFORE = {"OMNI_CUDA_PACKED": "0", "OMNI_RING_HOT_SPIN_US": "0"}


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Any:
    """os.environ with `values` set (the spawned receiver inherits them), restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _compare(sizes: list[int], requests: int, warmup: int, rounds: int) -> list[str]:
    rows = []
    for nbytes in sizes:
        res: dict[str, dict[str, list[float]]] = {}
        for _ in range(rounds):  # interleaved: load on the machine falls on both alike
            for name, env in (("before", _BEFORE), ("after", {})):
                with _environment(env):
                    one = asyncio.run(_cross(nbytes, requests, warmup))
                for k, v in one.items():
                    res.setdefault(name, {}).setdefault(k, []).extend(v)
        for name, label in (
            ("before", "pickle + clone, doorbell (before)"),
            ("after", "packed record + view, hot spin"),
        ):
            cells = (_cell(res[name][k]) for k in ("crossing", "encode", "receiver"))
            rows.append(tables.row([f"{nbytes >> 20} MiB", label, *cells]))
            print(rows[-1], flush=True)
    return rows


def _cell(values: list[float]) -> str:
    return f"{percentile(values, 50):.0f} / {percentile(values, 90):.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="omni-bench gpu-handoff", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--sizes-mib", default="1,64", help="tensor sizes, MiB, comma-separated")
    ap.add_argument(
        "--profile", action="store_true", help="only the crossing, under cProfile (where it goes)"
    )
    ap.add_argument(
        "--compare",
        action="store_true",
        help="only the crossing: the one-tensor fast path against the path before it",
    )
    ap.add_argument("--rounds", type=int, default=2, help="--compare: alternations per size")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("omni-bench gpu-handoff: needs a CUDA GPU", file=sys.stderr)
        return 2
    sizes = [0] + [int(float(s) * (1 << 20)) for s in args.sizes_mib.split(",")]
    if args.profile:
        asyncio.run(_cross(sizes[1], args.requests, args.warmup, profile=True))
        return 0
    if args.compare:
        rows = _compare(sizes[1:], args.requests, args.warmup, args.rounds)
        print()
        print(
            f"{torch.cuda.get_device_name()}: the crossing alone (sender's send_data to the "
            f"receiver's loop holding the usable tensor), {args.rounds} x {args.requests} "
            f"crossings per path after {args.warmup} warm-up each, interleaved; median / p90, "
            "microseconds:"
        )
        print()
        columns = ["tensor", "path", "crossing", "encode (sender)", "receiver"]
        print("\n".join(tables.header(columns)))
        print("\n".join(rows))
        return 0
    crossings = []
    for nbytes in sizes[1:]:
        res = asyncio.run(_cross(nbytes, args.requests, args.warmup))
        cells = (_cell(res[k]) for k in ("crossing", "encode", "receiver"))
        crossings.append(tables.row([f"{nbytes >> 20} MiB", *cells]))
        print(crossings[-1], flush=True)
    rows = []
    for same in (False, True):
        for nbytes in sizes:
            res = asyncio.run(_measure(same, nbytes, args.requests, args.warmup))
            what = f"{nbytes >> 20} MiB CUDA tensor" if nbytes else "tiny CPU payload (no tensor)"
            where = "one process" if same else "two processes"
            rows.append(tables.row([where, what, _cell(res["received"]), _cell(res["ready"])]))
            print(rows[-1], flush=True)
    print()
    print(
        f"{torch.cuda.get_device_name()}, {args.requests} requests one at a time after "
        f"{args.warmup} warm-up; microseconds from `make` returning to `take` called "
        "(received) and to its stream holding the data (ready), median / p90:"
    )
    print()
    print("\n".join(tables.header(["layout", "payload", "received", "ready"])))
    print("\n".join(rows))
    print()
    print(
        "The crossing alone, runtime endpoints at their defaults: sender's send_data to "
        "the receiver's loop holding the usable tensor; inside it the sender's encode and the "
        "receiver's side (ring, wake-up, decode); median / p90, microseconds:"
    )
    print()
    columns = ["tensor", "crossing", "encode (sender)", "ring, wake-up, decode (receiver)"]
    print("\n".join(tables.header(columns)))
    print("\n".join(crossings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
