"""`omni-bench ar-fanout`: what a step's chunks cost the runtime between processes.

An `ar` stage whose backend does no work (every request it holds advances one chunk a step)
streams to a terminal stream stage in another process that passes each chunk on; B requests of
N chunks each run at once, and the table gives chunks per second through the whole runtime
(coordinator, engine process, sink process) and steps per second of the ar stage. With no
model, that is the transport and the loops alone: the cost that batching a step's chunks into
one message per destination (`StreamChunks`) takes out of the sender's and the receiver's loop.

    omni-bench ar-fanout [--batch 1,16,64] [--chunks 200] [--rounds 3]

To compare two versions of the runtime, run this file with each (it writes its own repository
and uses only the runtime's public names), interleaved: the loops' cost is noisy on a shared
machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ENGINE = """\
backend = "model.py:Steps"
process = "engine"
stream_to = ["sink"]
[scheduler]
kind = "ar"
"""

SINK = """\
backend = "model.py:Pass"
process = "sink"
terminal = true
[scheduler]
kind = "stream"
"""

MODELS = """\
[models.m]
entry = "engine"
tasks = ["chat"]
"""

BACKENDS = """\
from omni_server.backend import StageBackend, StepOutput


class Steps(StageBackend):
    def initialize(self, context):
        self.held = {}

    def add(self, request):
        self.held[id(request)] = [request, 0, request.inputs["n"]]

    def step(self):
        outputs = []
        for key, entry in list(self.held.items()):
            request, i, n = entry
            output = StepOutput(request, chunk={"i": i})
            entry[1] = i + 1
            if i + 1 >= n:
                del self.held[key]
                output.finished = True
                output.result = {"n": n}
            outputs.append(output)
        return outputs

    def abort(self, request):
        self.held.pop(id(request), None)


class Pass(StageBackend):
    def initialize(self, context):
        pass

    def generate(self, request):
        count = 0
        for chunk in request.stream():
            yield chunk
            count += 1
        return {"n": count}
"""


def write_repo(root: Path) -> Path:
    for name, text in (("engine", ENGINE), ("sink", SINK)):
        (root / name).mkdir(parents=True)
        (root / name / "stage.toml").write_text(text)
        (root / name / "model.py").write_text(BACKENDS)
    (root / "repository.toml").write_text(MODELS)
    return root


async def one_level(runtime, model, batch: int, chunks: int) -> float:
    """Seconds for `batch` requests of `chunks` chunks each, all read to their result."""

    async def run(i: int) -> None:
        request = runtime.submit(model, {"n": chunks}, request_id=f"b{batch}-{i}")
        got = 0
        async for _ in request:
            got += 1
        result = await request.result()
        if got != chunks or result != {"n": chunks}:
            raise RuntimeError(f"request {i}: {got} chunks, result {result}")

    start = time.perf_counter()
    await asyncio.gather(*(run(i) for i in range(batch)))
    return time.perf_counter() - start


async def main_async(args: argparse.Namespace) -> None:
    from omni_server.compiler import compile_repository
    from omni_server.pipeline import Runtime

    with tempfile.TemporaryDirectory() as tmp:
        plan = compile_repository(write_repo(Path(tmp) / "repo"))
        runtime = Runtime(plan)
        await runtime.start()
        try:
            model = runtime.plan.models["m"]
            await one_level(runtime, model, 4, 20)  # warm-up
            print("| batch | chunks a request | rounds | chunks/s (median) | steps/s (median) |")
            print("| --- | --- | --- | --- | --- |")
            for batch in args.batch:
                seconds = [
                    await one_level(runtime, model, batch, args.chunks) for _ in range(args.rounds)
                ]
                median = statistics.median(seconds)
                print(
                    f"| {batch} | {args.chunks} | {args.rounds} | "
                    f"{batch * args.chunks / median:.0f} | {args.chunks / median:.0f} |",
                    flush=True,
                )
        finally:
            await runtime.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="omni-bench ar-fanout", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--batch", default="1,16,64", help="concurrent requests (the step's batch)")
    p.add_argument("--chunks", type=int, default=200, help="chunks a request")
    p.add_argument("--rounds", type=int, default=3, help="runs a level (median)")
    args = p.parse_args(argv)
    args.batch = [int(b) for b in args.batch.split(",")]
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
