"""Voice activity: which stretches of 16 kHz mono audio are speech, for a whole clip or live.

Two layers, so the ASR segmenter and a realtime turn detector share one idea of "an utterance":

  detector   audio frames -> speech probability per frame. `SileroVad` (the chosen one: Silero
             VAD v6, the ONNX copy that faster-whisper ships, on onnxruntime; no torch) and
             `WebRtcVad` (webrtcvad-wheels, the comparison; its 0/1 decisions as probabilities).
             `SileroVad.stream()` gives the same numbers frame by frame, carrying the state.
  tracker    `UtteranceTracker`: probabilities -> utterances, by hysteresis (start above
             `threshold`, end after `min_silence_s` below `threshold - 0.15`), padding, a
             minimum length and a maximum one (a long stretch is cut at its longest pause).
             `push()` takes one frame at a time and reports events as they become certain:
             what a turn detector needs; `segment_speech()` runs it over a whole clip.

docs/asr.md compares the two detectors on the embedded voice's speech with pauses.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

SAMPLE_RATE = 16_000


class SpeechDetector(Protocol):
    """Speech probability of each `frame_samples`-long frame of 16 kHz mono float32 audio."""

    frame_samples: int

    def probabilities(self, audio: np.ndarray) -> np.ndarray: ...


@functools.cache
def _silero_session():  # one session per process: it is read-only and thread-safe
    import onnxruntime
    from faster_whisper.utils import get_assets_path

    options = onnxruntime.SessionOptions()
    options.inter_op_num_threads = 1
    options.intra_op_num_threads = 1
    options.log_severity_level = 4
    path = Path(get_assets_path()) / "silero_vad_v6.onnx"
    return onnxruntime.InferenceSession(
        str(path), providers=["CPUExecutionProvider"], sess_options=options
    )


class SileroVad:
    """Silero VAD v6 on 32 ms frames (512 samples, each seen with the 64 samples before it)."""

    frame_samples = 512
    context_samples = 64
    state_shape = (1, 1, 128)  # the LSTM's h and c
    slice_frames = 1875  # 60 s of audio a run

    def __init__(self) -> None:
        self._session = _silero_session()

    def probabilities(self, audio: np.ndarray) -> np.ndarray:
        """One probability per frame; the last partial frame is zero-padded.

        The clip is read in slices of `slice_frames` (the LSTM's state carried across, so the
        numbers are one run's): what a call allocates, here and in onnxruntime's arena, which
        keeps its largest size, is a slice's, however long the clip."""
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)
        frames = -(-audio.size // self.frame_samples)
        h = np.zeros(self.state_shape, np.float32)
        c = np.zeros(self.state_shape, np.float32)
        out = np.zeros(frames, np.float32)
        step = self.slice_frames * self.frame_samples
        for first in range(0, frames, self.slice_frames):
            start = first * self.frame_samples
            piece = audio[start : start + step]
            count = -(-piece.size // self.frame_samples)
            windows = np.zeros((count, self.frame_samples), np.float32)  # [F, 512]
            windows.reshape(-1)[: piece.size] = piece
            context = np.zeros((count, self.context_samples), np.float32)  # [F, 64]
            context[1:] = windows[:-1, -self.context_samples :]
            if start:  # the frame before the slice
                context[0] = audio[start - self.context_samples : start]
            batch = np.concatenate([context, windows], axis=1)  # [F, 576]
            probs, h, c = self._session.run(None, {"input": batch, "h": h, "c": c})
            out[first : first + count] = np.asarray(probs, np.float32).reshape(-1)
        return out

    def stream(self) -> SileroStream:
        return SileroStream(self._session)


class SileroStream:
    """Frame-by-frame Silero for live audio; gives exactly `SileroVad.probabilities`' numbers."""

    frame_samples = SileroVad.frame_samples

    def __init__(self, session) -> None:
        self._session = session
        self._h = np.zeros(SileroVad.state_shape, np.float32)
        self._c = np.zeros(SileroVad.state_shape, np.float32)
        self._context = np.zeros((1, SileroVad.context_samples), np.float32)
        self._pending = np.zeros(0, np.float32)

    def push(self, audio: np.ndarray) -> np.ndarray:
        """Probabilities of the whole frames completed by `audio` (any length)."""
        self._pending = np.concatenate([self._pending, np.asarray(audio, np.float32).reshape(-1)])
        probs = []
        while self._pending.size >= self.frame_samples:
            frame = self._pending[None, : self.frame_samples]
            self._pending = self._pending[self.frame_samples :]
            x = np.concatenate([self._context, frame], axis=1)  # [1, 576]
            out, self._h, self._c = self._session.run(
                None, {"input": x, "h": self._h, "c": self._c}
            )
            self._context = frame[:, -SileroVad.context_samples :]
            probs.append(float(np.asarray(out).reshape(-1)[0]))
        return np.asarray(probs, np.float32)


class WebRtcVad:
    """webrtcvad's GMM detector on 30 ms frames; decisions 0/1 (aggressiveness 0..3)."""

    frame_samples = 480

    def __init__(self, aggressiveness: int = 2) -> None:
        import webrtcvad

        self._vad = webrtcvad.Vad(aggressiveness)

    def probabilities(self, audio: np.ndarray) -> np.ndarray:
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)
        frames = audio.size // self.frame_samples
        pcm = (np.clip(audio[: frames * self.frame_samples], -1, 1) * 32767).astype("<i2")
        step = self.frame_samples * 2
        data = pcm.tobytes()
        return np.array(
            [
                self._vad.is_speech(data[i * step : (i + 1) * step], SAMPLE_RATE)
                for i in range(frames)
            ],
            dtype=np.float32,
        )


@dataclass(frozen=True)
class Utterance:
    start: float  # seconds from the start of the audio
    end: float


@dataclass(frozen=True)
class SpeechStarted:
    """Speech has begun at `at` seconds (a turn detector's barge-in signal)."""

    at: float


@dataclass(frozen=True)
class SegmenterOptions:
    threshold: float = 0.5  # speech starts on a frame at or above this
    min_silence_s: float = 0.3  # this long below threshold - 0.15 ends an utterance
    pad_s: float = 0.2  # kept on each side of the speech frames (clamped to neighbours)
    min_speech_s: float = 0.1  # shorter bursts are dropped (clicks, breaths)
    max_utterance_s: float = 29.0  # Whisper hears 30 s windows: longer stretches are cut


class UtteranceTracker:
    """Turns per-frame probabilities into utterances, one frame at a time.

    Invariant: utterances come out in order, do not overlap, and each lies within
    [0, frames seen]. An utterance is reported once it is certain: after `min_silence_s` of
    silence, at `max_utterance_s`, or at `finish()`.
    """

    def __init__(self, frame_seconds: float, options: SegmenterOptions | None = None) -> None:
        self.options = options or SegmenterOptions()
        self.frame_s = frame_seconds
        self._neg = max(self.options.threshold - 0.15, 0.01)
        self._frame = 0  # index of the next frame pushed
        self._start: int | None = None  # first speech frame of the open utterance
        self._last_speech = 0  # last frame at or above the negative threshold (open utterance)
        self._silence = 0  # frames below the negative threshold at the end of the open one
        self._best_pause: tuple[int, int] = (0, 0)  # (length, first frame) of its longest pause
        self._last_end = 0.0  # end of the previous utterance, seconds: pads never cross it

    def push(self, probability: float) -> list[Utterance | SpeechStarted]:
        i = self._frame
        self._frame += 1
        if self._start is None:
            if probability >= self.options.threshold:
                self._start, self._last_speech, self._silence = i, i, 0
                self._best_pause = (0, 0)
                return [SpeechStarted(i * self.frame_s)]
            return []
        events: list[Utterance | SpeechStarted] = []
        if probability < self._neg:
            self._silence += 1
            if self._silence * self.frame_s >= self.options.min_silence_s:
                events += self._close(self._last_speech + 1)
                return events
        else:
            if self._silence and self._silence > self._best_pause[0]:
                self._best_pause = (self._silence, i - self._silence)
            self._silence = 0
            self._last_speech = i
        if (
            i + 1 - self._start
        ) * self.frame_s + 2 * self.options.pad_s > self.options.max_utterance_s:
            events += self._cut()
        return events

    def finish(self) -> list[Utterance]:
        """End of audio: close the open utterance, if any."""
        if self._start is None:
            return []
        return self._close(self._last_speech + 1)

    def _cut(self) -> list[Utterance | SpeechStarted]:
        """The open utterance reached the maximum: end it at its longest pause (or here)."""
        length, pause = self._best_pause
        end = pause if length else self._frame
        events: list[Utterance | SpeechStarted] = [*self._close(end)]
        self._start, self._last_speech, self._silence, self._best_pause = (
            end,
            self._frame - 1,
            0,
            (0, 0),
        )
        if length:  # speech after the pause continues as the next utterance
            self._start = pause + length
        return events

    def _close(self, end_frame: int) -> list[Utterance]:
        assert self._start is not None
        start_frame, self._start = self._start, None
        if (end_frame - start_frame) * self.frame_s < self.options.min_speech_s:
            return []
        pad = self.options.pad_s
        start = max(start_frame * self.frame_s - pad, self._last_end, 0.0)
        end = min(end_frame * self.frame_s + pad, self._frame * self.frame_s)
        self._last_end = end
        return [Utterance(round(start, 3), round(end, 3))]


def segment_speech(
    audio: np.ndarray,
    detector: SpeechDetector | None = None,
    options: SegmenterOptions | None = None,
) -> list[Utterance]:
    """The utterances of a whole 16 kHz clip (Silero unless another detector is given)."""
    detector = detector or SileroVad()
    probs = detector.probabilities(audio)
    found = utterances_from(probs, detector.frame_samples / SAMPLE_RATE, options)
    limit = np.asarray(audio).size / SAMPLE_RATE  # the last frame is zero-padded past the end
    return [Utterance(u.start, min(u.end, limit)) for u in found if u.start < limit]


def utterances_from(
    probabilities: Iterable[float], frame_seconds: float, options: SegmenterOptions | None = None
) -> list[Utterance]:
    tracker = UtteranceTracker(frame_seconds, options)
    found = [e for p in probabilities for e in tracker.push(float(p)) if isinstance(e, Utterance)]
    return found + tracker.finish()


def pack_windows(
    utterances: Iterable[Utterance], max_seconds: float = 30.0
) -> list[tuple[float, float]]:
    """Consecutive utterances joined into windows of at most `max_seconds` (gaps included).

    Whisper pads every input to a 30 s window, so one window holding several short utterances
    costs what one of them alone would: fewer, fuller windows are the cheap way through.
    """
    windows: list[tuple[float, float]] = []
    for u in utterances:
        if windows and u.end - windows[-1][0] <= max_seconds:
            windows[-1] = (windows[-1][0], u.end)
        else:
            windows.append((u.start, min(u.end, u.start + max_seconds)))
    return windows
