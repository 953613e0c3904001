"""How close forced alignment times words, against the embedded voice's own durations (a
benchmark script, not a test).

    python -m omni_bench.word_alignment [--dataset FILE] [--group 4] [--speeds 1,0.5,2]

The embedded Piper voice times each word from VITS's durations (the "timing" its chunks carry:
exact for its audio). Each group of `--group` consecutive texts of the dataset (default: the
held-out texts, never used to tune the aligner; `sentences.txt` was) is spoken in-process at
each speed, and its audio timed without those durations two ways:

  forced      the word_timing stage's aligner (omni_server.audio.forced_alignment), fed the
              audio in 640 ms pieces as they come (the Higgs vocoder's steady chunk;
              `--piece-ms`): segments at pauses, Whisper's alignment of the text
  transcribe  faster-whisper's own word timestamps on the whole clip (beam 5), its words matched
              to the text's by edit distance; a text word it did not hear takes the time
              between its neighbours'

Per method and speed: each word's start against the voice's (median, p95, max in ms), the last
word's end, and for `forced` how late a word's timing comes (audio seconds produced after the
word's end before its timing was ready) and the compute a segment cost.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from omni_bench.inprocess import InProcessVoice
from omni_bench.speech import load_dataset
from omni_server.audio.align_text import normalized, spoken_words
from omni_server.audio.decode import decode
from omni_server.audio.forced_alignment import Segmenting, StreamAligner, WhisperAligner
from omni_server.audio.resample import resample
from omni_server.audio.whisper import WHISPER_RATE
from omni_server.backend import Request
from omni_server.contracts import SpeechTiming

HELD_OUT = Path(__file__).parent / "data" / "heldout.txt"
REPOSITORY = Path(os.environ.get("OMNI_REPOSITORY", "repository"))
RATE = 24_000  # the body's rate (pcm's default): Higgs speaks at it too


@dataclass
class Spoken:
    """One utterance as the voice streamed it: its chunks' samples and its own timing."""

    chunks: list[np.ndarray]
    timing: SpeechTiming

    @property
    def seconds(self) -> float:
        return sum(len(c) for c in self.chunks) / RATE


@dataclass
class Errors:
    starts: list[float] = field(default_factory=list)  # |start - voice's start| per word, s
    last_ends: list[float] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)  # audio s produced past a word's end
    compute: list[float] = field(default_factory=list)  # s per aligned segment


def speak(voice: InProcessVoice, text: str, speed: float, seed: int) -> Spoken:
    inputs = voice.request(text, speed=speed, seed=seed, response_format="pcm", stream=True)
    request = Request(id=f"a{seed}", inputs={}, _stream=voice.sentences(inputs))
    chunks, timings = [], []
    for chunk in voice.encoder.generate(request):
        if chunk.get("audio"):
            chunks.append(decode(chunk["audio"], "pcm").samples)
        if isinstance(chunk.get(SpeechTiming.KEY), SpeechTiming):
            timings.append(chunk[SpeechTiming.KEY])
    return Spoken(chunks, SpeechTiming.joined(timings))


def forced(
    aligner: WhisperAligner, spoken: Spoken, errors: Errors, segmenting: Segmenting, piece: int
) -> list[tuple[float, float]]:
    """The aligner fed `piece` samples at a time (0: the voice's own chunks, a sentence or a
    first clause each)."""
    stream = StreamAligner(aligner, spoken.timing.text, RATE, segmenting)
    timed: list[SpeechTiming] = []
    produced = 0.0
    audio = np.concatenate(spoken.chunks)
    pieces = [audio[i : i + piece] for i in range(0, len(audio), piece)] if piece else spoken.chunks
    for samples in pieces:
        produced += len(samples) / RATE
        got = stream.push(samples)
        if got is not None:
            timed.append(got)
            errors.lags += [max(0.0, produced - w.end_s) for w in got.words]
    got = stream.finish()
    if got is not None:
        timed.append(got)
        errors.lags += [max(0.0, produced - w.end_s) for w in got.words]
    segments = stream.segments + 1
    errors.compute.append(stream.align_seconds / segments)
    return [(w.start_s, w.end_s) for w in SpeechTiming.joined(timed).words]


def transcribed(aligner: WhisperAligner, spoken: Spoken) -> list[tuple[float, float]]:
    audio = resample(np.concatenate(spoken.chunks), RATE, WHISPER_RATE)
    segments, _ = aligner.model.transcribe(
        audio, word_timestamps=True, beam_size=5, condition_on_previous_text=False
    )
    heard = [(normalized(w.word), w.start, w.end) for s in segments for w in s.words]
    heard = [h for h in heard if h[0]]
    text = [normalized(w.text) for w in spoken.timing.words]
    pairs = matched(text, [h[0] for h in heard])
    times: list[tuple[float, float] | None] = [None] * len(text)
    for t, h in pairs:
        times[t] = (float(heard[h][1]), float(heard[h][2]))
    return interpolated(times, spoken.seconds)


def matched(text: Sequence[str], heard: Sequence[str]) -> list[tuple[int, int]]:
    """(text index, heard index) of each word pair a word-level edit distance aligns (a
    substitution is a pair: a misheard word still marks where its text word was)."""
    n, m = len(text), len(heard)
    cost = np.zeros((n + 1, m + 1))
    cost[:, 0], cost[0, :] = np.arange(n + 1), np.arange(m + 1)
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            same = 0.0 if text[i - 1] == heard[j - 1] else 1.0
            cost[i, j] = min(cost[i - 1, j] + 1, cost[i, j - 1] + 1, cost[i - 1, j - 1] + same)
    pairs, i, j = [], n, m
    while i > 0 and j > 0:
        same = 0.0 if text[i - 1] == heard[j - 1] else 1.0
        if cost[i, j] == cost[i - 1, j - 1] + same:
            pairs.append((i - 1, j - 1))
            i, j = i - 1, j - 1
        elif cost[i, j] == cost[i - 1, j] + 1:
            i -= 1
        else:
            j -= 1
    return pairs[::-1]


def interpolated(
    times: Sequence[tuple[float, float] | None], seconds: float
) -> list[tuple[float, float]]:
    """A word without a time starts where the timed word before it ends (0 first) and ends
    where the next timed word starts (the clip's end last)."""
    out: list[tuple[float, float]] = []
    for index, held in enumerate(times):
        if held is not None:
            out.append(held)
            continue
        start = out[-1][1] if out else 0.0
        later = next((t for t in times[index + 1 :] if t is not None), None)
        out.append((start, later[0] if later is not None else seconds))
    return out


def score(errors: Errors, spoken: Spoken, times: Sequence[tuple[float, float]]) -> None:
    words = spoken.timing.words
    if len(times) != len(words):
        raise AssertionError(f"{len(times)} words timed for {len(words)}")
    errors.starts += [abs(t[0] - w.start_s) for t, w in zip(times, words, strict=True)]
    errors.last_ends.append(abs(times[-1][1] - words[-1].end_s))


def check_words(timing: SpeechTiming) -> None:
    """The voice's words are the aligner's (one definition of a word: spoken_words)."""
    mine = [(w.text, w.char_start, w.char_end) for w in spoken_words(timing.text)]
    if mine != [(w.text, w.char_start, w.char_end) for w in timing.words]:
        raise AssertionError(f"the voice's words are not the aligner's: {timing.text!r}")


def ms(values: Sequence[float], q: float) -> str:
    return f"{1000 * float(np.quantile(values, q)):.0f}" if values else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omni_bench.word_alignment", description=__doc__)
    p.add_argument("--dataset", type=Path, default=HELD_OUT, help="one text per line")
    p.add_argument("--group", type=int, default=4, help="texts spoken as one utterance")
    p.add_argument("--speeds", default="1,0.5,2", help="comma-separated speeds")
    p.add_argument("--methods", default="forced,transcribe", help="forced and/or transcribe")
    p.add_argument("--limit", type=int, default=0, help="at most this many utterances (0: all)")
    p.add_argument("--min-segment", type=float, default=Segmenting.min_segment_s,
                   help="the aligner's min_segment_s (a word_timing parameter)")  # fmt: skip
    p.add_argument("--piece-ms", type=float, default=640.0,
                   help="audio pushed at a time (the Higgs vocoder's steady chunk; 0: the "
                        "voice's own chunks, a sentence each)")  # fmt: skip
    p.add_argument("--repo", type=Path, default=REPOSITORY, help="the voice's repository")
    args = p.parse_args(argv)
    segmenting = Segmenting(min_segment_s=args.min_segment)
    piece = int(args.piece_ms * RATE / 1000)
    texts = load_dataset(args.dataset)
    groups = [" ".join(texts[i : i + args.group]) for i in range(0, len(texts), args.group)]
    groups = groups[: args.limit] if args.limit else groups
    speeds = [float(s) for s in args.speeds.split(",")]
    methods = args.methods.split(",")
    voice = InProcessVoice(args.repo)
    aligner = WhisperAligner(cpu_threads=1)
    print("| method | speed | words | start median ms | p95 | max | last end median ms | "
          "timing lag median s | p95 | compute / segment ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for speed in speeds:
        spoken = [speak(voice, text, speed, seed) for seed, text in enumerate(groups)]
        for method in methods:
            errors = Errors()
            for one in spoken:
                check_words(one.timing)
                times = forced(aligner, one, errors, segmenting, piece) if method == "forced" else (
                    transcribed(aligner, one))  # fmt: skip
                score(errors, one, times)
            lag = [
                f"{np.quantile(errors.lags, q):.2f}" if errors.lags else "-" for q in (0.5, 0.95)
            ]
            compute = ms(errors.compute, 0.5)
            print(f"| {method} | {speed:g} | {len(errors.starts)} | {ms(errors.starts, 0.5)} | "
                  f"{ms(errors.starts, 0.95)} | {ms(errors.starts, 1.0)} | "
                  f"{ms(errors.last_ends, 0.5)} | {lag[0]} | {lag[1]} | {compute} |",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
