"""The caller's audio not yet committed: decoded, resampled to 16 kHz, kept within a bound, and
listened to by server VAD.

`InputAudio` has no socket: `append` returns what the detector heard (speech started, an
utterance ended) and the session turns that into events, commits and responses. A new input
format or turn detection means a new `InputAudio` (a fresh buffer and detector).
"""

from __future__ import annotations

import base64
import binascii
import io
import wave

import numpy as np

from omni_server.audio.resample import StreamResampler
from omni_server.audio.vad import (
    SegmenterOptions,
    SileroStream,
    SileroVad,
    SpeechStarted,
    Utterance,
    UtteranceTracker,
)
from omni_server.serve.realtime import audio
from omni_server.serve.realtime.config import SessionConfig
from omni_server.serve.realtime.protocol import ProtocolError

VAD_RATE = 16_000
MAX_BUFFER_S = 120.0  # uncommitted input audio kept at most (older audio is dropped)
MIN_COMMIT_SAMPLES = VAD_RATE // 10  # a commit needs 100 ms of audio


class InputAudio:
    def __init__(self, config: SessionConfig) -> None:
        self.format = config.input_format
        self._resampler = StreamResampler(self.format.rate, VAD_RATE)
        self._pending = np.zeros(0, np.float32)  # uncommitted audio at 16 kHz
        self._pending_start_s = 0.0  # where _pending starts on the input timeline
        self.speech_item: str | None = None  # the item id a detected speech will commit as
        self._vad: SileroStream | None = None
        self._tracker: UtteranceTracker | None = None
        td = config.turn_detection
        if td is not None:
            self._vad = SileroVad().stream()
            options = SegmenterOptions(
                threshold=td.threshold,
                min_silence_s=td.silence_duration_ms / 1000,
                pad_s=td.prefix_padding_ms / 1000,
            )
            frame_s = SileroVad.frame_samples / VAD_RATE
            self._tracker = UtteranceTracker(frame_s, options)

    def append(self, raw: object) -> list[SpeechStarted | Utterance]:
        """Add one `input_audio_buffer.append`'s base64 audio; what the detector heard in it, in
        order (nothing without turn detection). The whole chunk is in the buffer before any of
        it is reported, so `take` finds an utterance's every sample."""
        if not isinstance(raw, str):
            raise ProtocolError("audio must be a base64 string", param="audio")
        try:
            data = base64.b64decode(raw, validate=True)
            samples = audio.decode(data, self.format)
        except (binascii.Error, ValueError) as err:
            raise ProtocolError(
                f"audio is not base64 {self.format.type}: {err}",
                code="invalid_audio",
                param="audio",
            ) from None
        heard = self._resampler.push(samples)
        self._pending = np.concatenate([self._pending, heard])
        overflow = self._pending.size - int(MAX_BUFFER_S * VAD_RATE)
        if overflow > 0:
            self._pending = self._pending[overflow:]
            self._pending_start_s += overflow / VAD_RATE
        if self._vad is None or self._tracker is None:
            return []
        return [
            found
            for probability in self._vad.push(heard)
            for found in self._tracker.push(float(probability))
        ]

    @property
    def nbytes(self) -> int:
        """Bytes of uncommitted audio held (at most MAX_BUFFER_S at 16 kHz float32: 7.5 MiB)."""
        return int(self._pending.nbytes)

    def take(self, utterance: Utterance) -> np.ndarray:
        """The utterance's audio; the buffer keeps only what came after it."""
        start = max(0, round((utterance.start - self._pending_start_s) * VAD_RATE))
        end = max(start, round((utterance.end - self._pending_start_s) * VAD_RATE))
        clip = self._pending[start:end]
        self._drop(end)
        return clip

    def take_all(self) -> np.ndarray:
        """Everything buffered (`input_audio_buffer.commit`); under 100 ms is refused."""
        if self._pending.size < MIN_COMMIT_SAMPLES:
            raise ProtocolError(
                "the input audio buffer holds less than 100 ms of audio",
                code="input_audio_buffer_commit_empty",
            )
        clip = self._pending
        self._drop(clip.size)
        return clip

    def clear(self) -> None:
        self._drop(self._pending.size)

    def _drop(self, samples: int) -> None:
        self._pending = self._pending[samples:]
        self._pending_start_s += samples / VAD_RATE


def wav(samples: np.ndarray, rate: int = VAD_RATE) -> bytes:
    """A committed clip as the WAV file the transcription model's decoder reads."""
    pcm = (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes()
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
    return out.getvalue()


def clip_seconds(data: bytes) -> float:
    """How long a clip that `wav` wrote lasts."""
    with wave.open(io.BytesIO(data), "rb") as w:
        return w.getnframes() / w.getframerate()
