"""Whisper as the judge of a voice's word timing, as sharp as Whisper tiny.en can be, and the
audio's own evidence beside it (a benchmark script; tests/voice/test_word_timing.py uses it).

    python -m omni_bench.word_judge [--dataset FILE] [--count 12] [--speeds 1,0.5,2] [--worst 10]
                                 [--lag]

The judge knows the text, so it does not transcribe: Whisper is handed the text's own tokens
and its alignment pass times them (`forced_alignment.WhisperAligner.force`: CTranslate2's
`align`, cross-attention of tiny.en's alignment heads, median filter 7 frames as OpenAI's,
dynamic time warping over 20 ms encoder frames), so every word is timed, in order, and no
misheard word or transcription artefact (words tiling time, beam choices) enters the judge.
Whisper's known quirks, and what the judge does about each:

- the first word: the warping path starts at frame 0, so the first word always starts at
  0.00 s whatever silence comes before it. The clip is cut at its voiced start
  (`voiced`: 10 ms RMS above 3 % of the loudest) and the first word is judged by that
  onset, not by Whisper; Whisper judges the second word on.
- padding: Whisper hears 30 s windows. The clip is padded with silence to 30 s before its
  log-mel, as OpenAI's Whisper does (faster-whisper pads the features with zeros instead,
  which reads as quiet noise, not silence); the alignment sees only the clip's own frames.
- the 20 ms frame: a word starts at the first encoder frame the path gives it (a frame's
  centre), so a start is known to +-10 ms. It is not what limits the judge: the median of
  four alignments shifted by 5 ms each was no closer on the tuning sentences, nor was any
  other choice of tiny.en's heads than its alignment heads (OpenAI's; docs/voice.md).
- its lag: Whisper places a word's start after its sound begins. On the tuning sentences
  (`sentences.txt`, `--lag`: words whose start follows >= 30 ms below -40 dB, against that
  silence's end) its starts lag the onset by 49, 77, 60 ms median at speed 1, 0.5, 2 (the
  voice's own starts by 4, 23, 0 ms): an error of the voice's durations would double at 0.5
  and halve at 2, this one does neither. The judge takes `LAG_S` (50 ms) off Whisper's
  starts; the raw figures are reported too.

Reported per speed: each word's start error (Whisper's minus the voice's, the first word
left out), raw and after the lag, median / p95 / max; the first word's start against the
voiced start and the last word's end against the voiced end; and the worst words, each with
its neighbours, both times and where the audio's sound begins near them (`onsets_in`), so
that whose error a large one is can be read off the audio.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omni_bench import asr_audio
from omni_server.audio.align_text import spoken_words
from omni_server.audio.forced_alignment import MAX_WINDOW_S, WhisperAligner
from omni_server.audio.resample import resample
from omni_server.audio.whisper import WHISPER_RATE
from omni_server.backend import Payload
from omni_server.contracts import SpeechTiming

LAG_S = 0.05  # Whisper's start after the sound's onset (module docstring: the tuning set's)
VOICED = 0.03  # of the loudest 10 ms RMS: where a clip's voice starts and stops
QUIET_DB = -40.0  # below the loudest 10 ms: silence, for `onsets_in`
QUIET_FRAMES = 3  # 30 ms of it before a sound counts as an onset


def voiced(audio: np.ndarray, rate: int) -> tuple[float, float]:
    """When `audio` is first and last voiced (10 ms RMS above VOICED of its loudest), s."""
    hop = rate // 100
    rms = np.sqrt(np.convolve(audio.astype(np.float64) ** 2, np.ones(hop) / hop, mode="same"))
    loud = np.nonzero(rms > VOICED * rms.max())[0]
    return loud[0] / rate, loud[-1] / rate


def levels_db(audio: np.ndarray, rate: int) -> np.ndarray:
    """Each 10 ms frame's RMS in dB below the loudest frame ([frames], 0 the loudest)."""
    hop = rate // 100
    frames = len(audio) // hop
    rms = np.sqrt(np.mean(audio[: frames * hop].astype(np.float64).reshape(frames, hop) ** 2, 1))
    return 20 * np.log10(rms / rms.max() + 1e-9)


def onsets_in(levels: np.ndarray, start_s: float, end_s: float) -> tuple[float, ...]:
    """The onsets in [start_s, end_s] (s): frames above QUIET_DB after at least QUIET_FRAMES
    at or below it (a word after a pause, a stop's burst after its closure; not where a word
    runs on from a vowel: there the energy does not show its start, and none is found)."""
    found: list[float] = []
    quiet = 0
    first, last = int(start_s * 100), min(int(end_s * 100) + 1, len(levels))
    for frame in range(max(0, first - QUIET_FRAMES), last):
        if levels[frame] <= QUIET_DB:
            quiet += 1
            continue
        if quiet >= QUIET_FRAMES and frame >= first:
            found.append(frame / 100)
        quiet = 0
    return tuple(found)


class WhisperJudge:
    """Whisper tiny.en's forced alignment of a clip's known text (see the module docstring)."""

    def __init__(self, aligner: WhisperAligner | None = None) -> None:
        self.aligner = aligner or WhisperAligner(cpu_threads=2)

    def times(self, audio: np.ndarray, rate: int, text: str) -> list[tuple[float, float]]:
        """Each spoken word of `text` (`align_text.spoken_words`) as Whisper hears it in
        `audio` (mono float32 at `rate`, at most 30 s): (start, end) in seconds of the clip,
        raw (no lag taken off); the first word starts at the voiced start by construction."""
        onset, _ = voiced(audio, rate)
        clip = resample(audio, rate, WHISPER_RATE)[int(onset * WHISPER_RATE) :]
        window = int(MAX_WINDOW_S * WHISPER_RATE)
        if len(clip) > window:
            raise ValueError(f"the judge hears {MAX_WINDOW_S:g} s at most, got {len(clip)} samples")
        model = self.aligner.model
        features = model.feature_extractor(np.pad(clip, (0, window - len(clip))))
        frames = len(clip) // model.feature_extractor.hop_length + 1  # the clip's own frames
        encoded = model.encode(features[:, : int(MAX_WINDOW_S * 100)])
        times = self.aligner.force((encoded, frames), text, spoken_words(text))
        return [(onset + start, onset + end) for start, end in times]


@dataclass(frozen=True)
class Judged:
    """One word of a clip: its neighbours' texts, the voice's start and Whisper's (raw)."""

    clip: int
    index: int
    before: str
    word: str
    after: str
    ours_s: float
    whisper_s: float
    onsets_s: tuple[float, ...]  # the audio's onsets around both starts (`onsets_in`)
    lag_onset_s: float | None  # the last onset from 150 ms before Whisper's start to 60 after

    @property
    def lag_s(self) -> float | None:
        """Whisper's raw start after the sound's onset (what LAG_S is measured from)."""
        return None if self.lag_onset_s is None else self.whisper_s - self.lag_onset_s

    @property
    def error_s(self) -> float:
        """Whisper's start, its lag taken off, minus the voice's."""
        return self.whisper_s - LAG_S - self.ours_s


@dataclass
class Verdict:
    """A set of clips judged: the words from the second of each clip on, and the edges."""

    words: list[Judged]
    first_starts: list[float]  # |first word's start - voiced start| per clip, s
    last_ends: list[float]  # |last word's end - voiced end| per clip, s

    def errors_ms(self, *, raw: bool = False) -> np.ndarray:
        return 1000 * np.array([w.error_s + (LAG_S if raw else 0.0) for w in self.words])


def judge(whisper: WhisperJudge, clips: Sequence[tuple[np.ndarray, int, SpeechTiming]]) -> Verdict:
    """Each clip's (audio, rate, the voice's timing) judged."""
    verdict = Verdict([], [], [])
    for index, (audio, rate, timing) in enumerate(clips):
        theirs = whisper.times(audio, rate, timing.text)
        ours = timing.words
        if [w.text for w in spoken_words(timing.text)] != [w.text for w in ours]:
            raise AssertionError(f"the voice's words are not the aligner's: {timing.text!r}")
        levels = levels_db(audio, rate)
        for k in range(1, len(ours)):
            mine, heard = ours[k].start_s, theirs[k][0]
            near = onsets_in(levels, min(mine, heard - LAG_S) - 0.1, max(mine, heard) + 0.02)
            lagged = onsets_in(levels, heard - 0.15, heard + 0.06)
            after = ours[k + 1].text if k + 1 < len(ours) else ""
            verdict.words.append(
                Judged(
                    index, k, ours[k - 1].text, ours[k].text, after, mine, heard, near,
                    lagged[-1] if lagged else None,
                )
            )  # fmt: skip
        first, last = voiced(audio, rate)
        verdict.first_starts.append(abs(ours[0].start_s - first))
        verdict.last_ends.append(abs(ours[-1].end_s - last))
    return verdict


def spoken(chunks: Iterable[Payload]) -> tuple[np.ndarray, int, SpeechTiming]:
    """A clip as the voice's acoustic stage made it: its audio, rate and timing, joined."""
    chunks = list(chunks)
    audio = np.concatenate([c["audio"] for c in chunks])
    timing = SpeechTiming.joined([c[SpeechTiming.KEY] for c in chunks if SpeechTiming.KEY in c])
    return audio, int(chunks[0]["sample_rate"]), timing


def _stats(values: np.ndarray) -> str:
    return " | ".join(f"{np.percentile(np.abs(values), q):.0f}" for q in (50, 95, 100))


def main(argv: list[str] | None = None) -> int:
    from omni_bench.inprocess import InProcessVoice  # the voice: only where a clip is spoken

    p = argparse.ArgumentParser(prog="python -m omni_bench.word_judge", description=__doc__)
    p.add_argument("--dataset", type=Path, default=asr_audio.HELD_OUT, help="one text a line")
    p.add_argument("--count", type=int, default=12, help="the first COUNT texts (seeds 0..)")
    p.add_argument("--speeds", default="1,0.5,2", help="comma-separated speeds")
    p.add_argument("--worst", type=int, default=10, help="list this many worst words a speed")
    p.add_argument("--lag", action="store_true",
                   help="also measure Whisper's lag after the audio's onsets (LAG_S: measured on "
                        "sentences.txt, never on the held-out texts)")  # fmt: skip
    p.add_argument("--repo", type=Path, default=asr_audio.REPOSITORY, help="the voice's repository")
    args = p.parse_args(argv)
    voice = InProcessVoice(args.repo)
    whisper = WhisperJudge()
    texts = asr_audio.sentences(args.count, source=args.dataset)
    print("| speed | words | raw median ms | p95 | max | Whisper - ours, median | "
          "after lag: median | p95 | max | first start vs voiced, median / max | "
          "last end vs voiced, median / max |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    verdicts = {}
    for speed in [float(s) for s in args.speeds.split(",")]:
        clips = [
            spoken(voice.sentences(voice.request(text, seed=seed, speed=speed)))
            for seed, text in enumerate(texts)
        ]
        verdict = verdicts[speed] = judge(whisper, clips)
        raw, fixed = verdict.errors_ms(raw=True), verdict.errors_ms()
        edges = [1000 * np.array(e) for e in (verdict.first_starts, verdict.last_ends)]
        print(f"| {speed:g} | {len(raw)} | {_stats(raw)} | {np.median(raw):+.0f} | "
              f"{_stats(fixed)} | {np.median(edges[0]):.0f} / {edges[0].max():.0f} | "
              f"{np.median(edges[1]):.0f} / {edges[1].max():.0f} |", flush=True)  # fmt: skip
    if args.lag:
        print("\n| speed | words after a silence | Whisper's start - onset, median ms | "
              "ours - onset, median ms |\n|---|---:|---:|---:|")  # fmt: skip
        for speed, verdict in verdicts.items():
            lagged = [w for w in verdict.words if w.lag_onset_s is not None]
            theirs = 1000 * np.median([w.lag_s for w in lagged])
            ours = 1000 * np.median([w.ours_s - (w.lag_onset_s or 0.0) for w in lagged])
            print(f"| {speed:g} | {len(lagged)} | {theirs:+.0f} | {ours:+.0f} |")
    for speed, verdict in verdicts.items():
        print(f"\nspeed {speed:g}, worst {args.worst} (after lag; times in s of the clip; "
              f"onset: the audio's, {QUIET_DB:g} dB)")  # fmt: skip
        print("| clip | words | ours s | Whisper s (raw) | error ms | onsets s |")
        print("|---|---|---:|---:|---:|---|")
        for w in sorted(verdict.words, key=lambda w: -abs(w.error_s))[: args.worst]:
            onsets = ", ".join(f"{t:.2f}" for t in w.onsets_s) or "none (no silence before)"
            print(f"| {w.clip} | {w.before} **{w.word}** {w.after} | {w.ours_s:.3f} | "
                  f"{w.whisper_s:.3f} | {1000 * w.error_s:+.0f} | {onsets} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
