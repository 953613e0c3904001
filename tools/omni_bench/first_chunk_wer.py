"""What the short first chunk costs in intelligibility (a benchmark script, not a test).

    python -m omni_bench.first_chunk_wer [--words 0,5] [--seeds 1,2,3] [--dataset FILE]

Each text of the dataset (default: the held-out texts, never used to tune the voice) is
synthesized in-process with the text frontend's `first_chunk_words` at each value (0: whole
sentences, no cut), once per seed (the seed of text i is seed * 1000 + i), transcribed by the
served ASR's recognizer (`omni_bench.wer.Transcriber`) and scored: one corpus WER per value and
seed, and the worst clips, as a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from omni_bench.inprocess import InProcessVoice
from omni_bench.speech import load_dataset
from omni_bench.wer import Transcriber, score
from omni_server.audio.decode import decode

HELD_OUT = Path(__file__).parent / "data" / "heldout.txt"
REPOSITORY = Path(os.environ.get("OMNI_REPOSITORY", "repository"))


def integers(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omni_bench.first_chunk_wer", description=__doc__)
    p.add_argument("--words", type=integers, default=[0, 5], help="first_chunk_words values")
    p.add_argument("--seeds", type=integers, default=[1, 2, 3], help="one draw per seed")
    p.add_argument("--dataset", type=Path, default=HELD_OUT, help="one text per line")
    p.add_argument("--repo", type=Path, default=REPOSITORY, help="the voice's repository")
    args = p.parse_args(argv)
    texts = load_dataset(args.dataset)
    voice = InProcessVoice(args.repo)
    transcriber = Transcriber()
    print("| first_chunk_words | seed | corpus WER | worst clip (reference => transcript) |")
    print("|---|---|---|---|")
    for words in args.words:
        voice.frontend.first_chunk_words = words  # read per request
        for seed in args.seeds:
            transcripts = []
            for i, text in enumerate(texts):
                speech = voice.speak(text, seed=seed * 1000 + i, response_format="wav")
                transcripts.append(transcriber.transcribe(decode(b"".join(speech.chunks))))
            report = score(texts, transcripts, keep_worst=1)
            worst = report.worst[0] if report.worst else {"reference": "", "transcript": ""}
            print(
                f"| {words} | {seed} | {report.corpus_wer:.2%} | "
                f"{worst['reference']} => {worst['transcript']} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
