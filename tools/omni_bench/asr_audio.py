"""Speech made on this machine for the ASR benchmark: the embedded voice, espeak-ng, pauses, noise.

Every clip is 16 kHz mono float32 with the text it says, so transcripts can be scored. A long
file is clips joined by seeded pauses, with the sample spans of the speech kept as the ground
truth for voice-activity boundaries.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

from omni_server.audio.resample import resample

RATE = 16_000
# the embedded repository, from the working directory (a source checkout) unless the
# environment names another: an installed omni_bench has no repository beside it
REPOSITORY = Path(os.environ.get("OMNI_REPOSITORY", "repository"))
SENTENCES = Path(__file__).parent / "data" / "sentences.txt"
# texts no setting was tuned on (the voice's nor the recognizer's): held-out quality checks
HELD_OUT = Path(__file__).parent / "data" / "heldout.txt"


@dataclass
class Speech:
    samples: np.ndarray  # [n] float32, 16 kHz
    text: str
    spans: list[tuple[int, int]]  # sample ranges where a clip is (speech, with its own edges)

    @property
    def seconds(self) -> float:
        return self.samples.size / RATE


def sentences(count: int, *, max_words: int = 30, source: Path = SENTENCES) -> list[str]:
    """The first `count` texts of the speech dataset (or of `source`, e.g. HELD_OUT) with at
    most `max_words` words."""
    lines = [ln.strip() for ln in source.read_text(encoding="utf-8").splitlines()]
    texts = [ln for ln in lines if ln and not ln.startswith("#") and len(ln.split()) <= max_words]
    if len(texts) < count:
        raise ValueError(f"{source} has only {len(texts)} texts of <= {max_words} words")
    return texts[:count]


def decode_file(data: bytes) -> np.ndarray:
    """Any container PyAV reads -> 16 kHz mono float32."""
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="flt", layout="mono", rate=RATE)
        parts = [
            f.to_ndarray().reshape(-1)
            for fr in container.decode(stream)
            for f in resampler.resample(fr)
        ]
        parts += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)


class VoiceSynth:
    """The embedded Piper voice, run in this process (no server)."""

    name = "piper-joe"

    def __init__(self) -> None:
        from omni_bench.inprocess import InProcessVoice

        self._voice = InProcessVoice(REPOSITORY)

    def say(self, text: str) -> np.ndarray:
        speech = self._voice.speak(text, response_format="wav", seed=0)
        return decode_file(speech.body)


class EspeakSynth:
    """espeak-ng (the Debian package): a formant voice, harder for Whisper than Piper's."""

    name = "espeak-ng"

    def __init__(self) -> None:
        if shutil.which("espeak-ng") is None:
            raise RuntimeError("espeak-ng is not installed (apt-get install espeak-ng)")

    def say(self, text: str) -> np.ndarray:
        wav = subprocess.run(
            ["espeak-ng", "-v", "en-us", "-s", "165", "--stdout", text],
            check=True,
            capture_output=True,
            timeout=60,
        ).stdout
        return decode_file(wav)


def join_with_pauses(
    clips: Sequence[np.ndarray],
    texts: Sequence[str],
    *,
    pause_s: tuple[float, float],
    seed: int = 0,
) -> Speech:
    """Clips one after another with uniform random pauses between them (and around them)."""
    rng = np.random.default_rng(seed)
    parts, spans, at = [], [], 0
    for clip in clips:
        gap = np.zeros(int(rng.uniform(*pause_s) * RATE), np.float32)
        parts += [gap, clip]
        at += gap.size
        spans.append((at, at + clip.size))
        at += clip.size
    parts.append(np.zeros(int(pause_s[0] * RATE), np.float32))
    return Speech(np.concatenate(parts), " ".join(texts), spans)


def add_noise(samples: np.ndarray, snr_db: float, seed: int = 0) -> np.ndarray:
    """White Gaussian noise at `snr_db` below the power of the speech (non-silent samples)."""
    active = samples[np.abs(samples) > 1e-4]
    power = float(np.mean(active**2)) if active.size else 1e-6
    noise = np.random.default_rng(seed).standard_normal(samples.size) * np.sqrt(
        power / 10 ** (snr_db / 10)
    )
    return np.clip(samples + noise.astype(np.float32), -1, 1).astype(np.float32)


def to_wav(samples: np.ndarray, rate: int = RATE) -> bytes:
    """16-bit PCM WAV bytes of float32 mono samples (an upload)."""
    from omni_server.audio.wav import wav_header

    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()
    return wav_header(rate, data_bytes=len(pcm)) + pcm


def voiced_edges(clip: np.ndarray, *, floor_db: float = -40.0) -> tuple[int, int]:
    """First and last sample of a clip's speech: 10 ms frames above `floor_db` of its peak."""
    frame = RATE // 100
    n = clip.size // frame
    if n == 0:
        return 0, clip.size
    rms = np.sqrt(np.mean(clip[: n * frame].reshape(n, frame) ** 2, axis=1) + 1e-12)
    loud = np.flatnonzero(20 * np.log10(rms / (rms.max() + 1e-12)) > floor_db)
    return int(loud[0] * frame), int((loud[-1] + 1) * frame)


def resample_to_16k(samples: np.ndarray, rate: int) -> np.ndarray:
    return resample(samples, rate, RATE)
