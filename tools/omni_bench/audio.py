"""Turning a response body into samples: raw PCM directly, every container through PyAV."""

from __future__ import annotations

import io
from dataclasses import dataclass

import av
import numpy as np

PCM_SAMPLE_RATE = 24_000  # the server's `pcm` format: s16le mono at 24 kHz (OpenAI's contract)


@dataclass
class Clip:
    """Decoded mono audio."""

    samples: np.ndarray  # [n] float32 in [-1, 1]
    sample_rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate


def pcm16_to_clip(body: bytes, sample_rate: int = PCM_SAMPLE_RATE) -> Clip:
    if len(body) % 2:
        raise ValueError(f"raw s16le body has an odd byte count ({len(body)})")
    samples = np.frombuffer(body, dtype="<i2").astype(np.float32) / 32768.0
    return Clip(samples, sample_rate)


def decode(body: bytes, response_format: str) -> Clip:
    """Decode a whole response body of the given OpenAI `response_format`."""
    if response_format == "pcm":
        return pcm16_to_clip(body)
    try:
        with av.open(io.BytesIO(body), mode="r") as container:
            stream = container.streams.audio[0]
            rate = stream.rate or stream.codec_context.sample_rate
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            parts = []
            for frame in container.decode(stream):
                parts.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(frame))
            parts.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(None))
    except (av.error.FFmpegError, IndexError) as err:
        raise ValueError(
            f"cannot decode a {response_format} body of {len(body)} bytes: {err}"
        ) from err
    samples = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    return Clip(samples.astype(np.float32, copy=False), int(rate))
