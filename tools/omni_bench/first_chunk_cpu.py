"""What a request's first audio chunk costs the voice (a benchmark script, not a test).

    python -m omni_bench.first_chunk_cpu [--words 0,4,5] [--peer DIR] [--rounds 2]

Each text of the dataset (default: the held-out texts) is synthesized in-process, seeded (one
onnxruntime thread, as seeded requests run), at each `first_chunk_words` value, and, with
`--peer`, by another repository's voice (e.g. an older commit's, exported with `git archive`)
at its own stage files' setting; variants take turns text by text, so machine load hits them
alike. Measured in CPU time of the calling thread (what other jobs on a shared machine disturb
least): the acoustic stage's first step (the request's first chunk: its time to first audio,
less the pipeline) and the whole text; and how long the first chunk plays (the lead the rest
of the sentence is synthesized in). One markdown table of medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from omni_bench.first_chunk_wer import HELD_OUT, REPOSITORY, integers
from omni_bench.inprocess import InProcessVoice
from omni_bench.speech import load_dataset


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omni_bench.first_chunk_cpu", description=__doc__)
    p.add_argument("--words", type=integers, default=[0, 4, 5], help="first_chunk_words values")
    p.add_argument("--peer", type=Path, help="another repository's voice, at its own setting")
    p.add_argument("--rounds", type=int, default=2, help="passes over the dataset")
    p.add_argument("--dataset", type=Path, default=HELD_OUT, help="one text per line")
    p.add_argument("--repo", type=Path, default=REPOSITORY, help="the voice's repository")
    args = p.parse_args(argv)
    texts = load_dataset(args.dataset)
    voice = InProcessVoice(args.repo)
    variants: list[tuple[str, InProcessVoice, int]] = [
        (f"{args.repo} first_chunk_words {w}", voice, w) for w in args.words
    ]
    if args.peer is not None:
        peer = InProcessVoice(args.peer)
        setting = peer.frontend.first_chunk_words
        variants.insert(0, (f"{args.peer} first_chunk_words {setting}", peer, setting))
    first: dict[str, list[float]] = {name: [] for name, *_ in variants}
    whole: dict[str, list[float]] = {name: [] for name, *_ in variants}
    plays: dict[str, list[float]] = {name: [] for name, *_ in variants}
    for _ in range(args.rounds):
        for index, text in enumerate(texts):
            for name, which, words in variants:
                which.frontend.first_chunk_words = words  # read per request
                chunks = which.sentences(which.request(text, seed=index))
                start = time.thread_time()
                chunk = next(chunks)
                first[name].append(time.thread_time() - start)
                plays[name].append(len(chunk["audio"]) / chunk["sample_rate"])
                for _rest in chunks:
                    pass
                whole[name].append(time.thread_time() - start)
    print("| voice | first chunk CPU ms | first chunk plays s | whole text CPU ms |")
    print("|---|---:|---:|---:|")
    for name, *_ in variants:
        print(
            f"| {name} | {statistics.median(first[name]) * 1e3:.0f} | "
            f"{statistics.median(plays[name]):.2f} | {statistics.median(whole[name]) * 1e3:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
