"""The embedded voice under different placements of its stages through the real runtime:
replicas of its process, onnxruntime threads per acoustic session, the acoustic stage in a
process of its own (a benchmark script behind a table of docs/voice.md).

    python -m omni_bench.voice_placement [--rounds N] [--only WORD ...]

Each placement is a set of dotted overrides on `repository/` (no file edited). For each: time
to first audio (TTFA) of a three-sentence paragraph at concurrency 1, then requests/s and
median TTFA at concurrency 2 and 4 (streamed pcm, seeded). Placements run interleaved,
`--rounds` times, and the table keeps each metric's best round: other work on a shared machine
only ever slows one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

from omni_bench.harness import tables
from omni_server.compiler import compile_repository
from omni_server.contracts import SpeechOptions, speech_payload
from omni_server.pipeline import Runtime

# the embedded repository, from the working directory (a source checkout) unless the
# environment names another: an installed omni_bench has no repository beside it
REPOSITORY = Path(os.environ.get("OMNI_REPOSITORY", "repository"))
PARAGRAPH = (
    "The sun rose slowly over the quiet hills. Birds began to sing in the tall trees. "
    "A new day had started in the little town by the river."
)
ONE = ["--processes.voice.num_replicas", "1"]
TWO_THREADS = ["--stages.acoustic.parameters.intra_op_threads", "2"]
OWN_ACOUSTIC = ["--stages.acoustic.process", "acoustic"]
PLACEMENTS = {
    "voice x 1, 1 thread": ONE,
    "voice x 1, 2 threads": ONE + TWO_THREADS,
    "voice x 1 + acoustic x 1, 1 thread": ONE + OWN_ACOUSTIC,
    "voice x 1 + acoustic x 2, 1 thread": ONE + OWN_ACOUSTIC
    + ["--processes.acoustic.num_replicas", "2"],
    "voice x 2, 1 thread (default)": [],
    "voice x 2, 2 threads": TWO_THREADS,
}  # fmt: skip


async def speak(runtime: Runtime, model, seed: int) -> tuple[float, float]:
    """(TTFA, total) seconds of one streamed request."""
    start = time.perf_counter()
    first = None
    speech = SpeechOptions("joe", response_format="pcm", stream=True, seed=seed)
    handle = runtime.submit(model, speech_payload(PARAGRAPH, speech))
    async for _chunk in handle:
        if first is None:
            first = time.perf_counter() - start
    await handle.result()
    assert first is not None
    return first, time.perf_counter() - start


async def measure(overrides: list[str]) -> dict[str, float]:
    plan = compile_repository(REPOSITORY, overrides)
    runtime = Runtime(plan)
    await runtime.start()
    model = plan.models["piper-joe"]
    try:
        await speak(runtime, model, 0)  # warm-up
        row = {
            "c1_ttfa": statistics.median([(await speak(runtime, model, s))[0] for s in range(5)])
        }
        for concurrency in (2, 4):
            start = time.perf_counter()
            results = await asyncio.gather(
                *[speak(runtime, model, s) for s in range(3 * concurrency)]
            )
            row[f"c{concurrency}_rps"] = len(results) / (time.perf_counter() - start)
            row[f"c{concurrency}_ttfa"] = statistics.median(r[0] for r in results)
        return row
    finally:
        await runtime.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--only", nargs="*", default=[], help="placements whose names contain these"
    )
    args = parser.parse_args()
    chosen = {
        name: overrides
        for name, overrides in PLACEMENTS.items()
        if not args.only or any(word in name for word in args.only)
    }
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for name, overrides in chosen.items():
            row = asyncio.run(measure(overrides))
            old = best.setdefault(name, row)
            for key, value in row.items():  # per metric: the least disturbed round
                old[key] = max(old[key], value) if key.endswith("rps") else min(old[key], value)
    print(f"\nparagraph: 3 sentences, ~7.6 s of audio; best of {args.rounds} rounds\n")
    columns = ["placement", "TTFA c=1 ms", "req/s c=2", "TTFA c=2 ms", "req/s c=4", "TTFA c=4 ms"]
    print("\n".join(tables.header(columns, "lrrrrr")))
    for name, r in best.items():
        cells = [f"{r['c1_ttfa'] * 1e3:.0f}", f"{r['c2_rps']:.2f}", f"{r['c2_ttfa'] * 1e3:.0f}"]
        cells += [f"{r['c4_rps']:.2f}", f"{r['c4_ttfa'] * 1e3:.0f}"]
        print(tables.row([name, *cells]))


if __name__ == "__main__":
    main()
