"""Decoding a response body back to float32 mono samples: the one decoder of the tests, the
benchmark and the clients' tests.

Raw `pcm` (s16le) is scaled by 1/32768, the convention of every decoder we compare against:
FFmpeg (PyAV, so our own `wav` and `flac` bodies), libsndfile, torchaudio. With it, the same
samples sent as `pcm` and as `wav` decode to the same floats, and the scale is a power of two
(exact in float32, -32768 -> -1.0). The encoder's 1/32767 (Piper's, which keeps +1.0 in range)
makes a round trip 3e-5 quieter: far below anything a test or WER can see.
"""

from __future__ import annotations

import io
from typing import NamedTuple

import av
import numpy as np

from omni_server.audio.containers import cut_short

PCM_SAMPLE_RATE = 24_000  # OpenAI's `pcm`: s16le mono at 24 kHz
PCM_SCALE = 32768.0


class Clip(NamedTuple):
    """Decoded mono audio; unpacks as `samples, sample_rate = decode(...)`."""

    samples: np.ndarray  # [n] float32 in [-1, 1)
    sample_rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate


def pcm_to_clip(body: bytes, sample_rate: int = PCM_SAMPLE_RATE) -> Clip:
    if len(body) % 2:
        raise ValueError(f"raw s16le body has an odd byte count ({len(body)})")
    return Clip(np.frombuffer(body, dtype="<i2").astype(np.float32) / PCM_SCALE, sample_rate)


class TooLong(ValueError):
    """The audio runs past the `max_seconds` its decoder was given."""


class Truncated(ValueError):
    """The body decodes, but ends before its container says it does (`containers.cut_short`)."""


def decode(
    body: bytes,
    response_format: str | None = None,
    *,
    pcm_rate: int = PCM_SAMPLE_RATE,
    max_seconds: float | None = None,
    whole: bool = False,
) -> Clip:
    """A whole body of OpenAI `response_format` (None: any container FFmpeg recognizes) as one
    clip; raw `pcm` carries no rate, so it is `pcm_rate`. Channels are mixed down to mono.
    Raises ValueError for a body that is no audio of that format, TooLong (a ValueError) as
    soon as the decoded audio passes `max_seconds`: a small, highly compressed body can hold
    hours, and decoding stops there instead of filling memory. `whole`: a body cut short (its
    container promises more than it holds, `containers.cut_short`) raises Truncated (a
    ValueError) instead of giving the audio up to the cut."""
    if response_format == "pcm":
        return pcm_to_clip(body, pcm_rate)
    try:
        with av.open(io.BytesIO(body), mode="r") as container:
            stream = container.streams.audio[0]
            rate = stream.rate or stream.codec_context.sample_rate
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            parts: list[np.ndarray] = []
            limit = None if max_seconds is None else int(max_seconds * rate)
            decoded = 0
            for frame in container.decode(stream):
                parts.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(frame))
                decoded += frame.samples
                if limit is not None and decoded > limit:
                    raise TooLong(f"the audio is longer than {max_seconds:g} s")
            parts.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(None))
            container_format = str(container.format.name)
            declared = container.duration / 1e6 if container.duration else None
    except (av.error.FFmpegError, IndexError) as err:
        what = response_format or "audio"
        raise ValueError(f"cannot decode a {what} body of {len(body)} bytes: {err}") from err
    samples = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    if whole:
        cut = cut_short(body, container_format, declared, len(samples) / rate)
        if cut is not None:
            raise Truncated(f"the audio is truncated or corrupt: {cut}")
    return Clip(samples.astype(np.float32, copy=False), int(rate))


def container_name(body: bytes) -> str:
    """FFmpeg's name for the body's container ("wav", "mp3", "ogg", "flac", "aac", ...)."""
    try:
        with av.open(io.BytesIO(body), mode="r") as container:
            return str(container.format.name)
    except av.error.FFmpegError as err:
        raise ValueError(f"a body of {len(body)} bytes is in no known container: {err}") from err
