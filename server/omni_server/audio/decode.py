"""Decoding a response body back to float32 mono samples (tests and quality checks)."""

from __future__ import annotations

import io

import av
import numpy as np


def decode(data: bytes, response_format: str, *, pcm_rate: int = 24_000) -> tuple[np.ndarray, int]:
    """(samples float32 mono, sample rate) of a whole body; pcm needs its rate (`pcm_rate`)."""
    if response_format == "pcm":
        if len(data) % 2:
            raise ValueError(f"pcm body has an odd byte count ({len(data)})")
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0, pcm_rate
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.audio[0]
        rate = stream.codec_context.sample_rate
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        parts = []
        for frame in container.decode(stream):
            parts.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(frame))
        parts.extend(f.to_ndarray().reshape(-1) for f in resampler.resample(None))
    samples = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    return samples.astype(np.float32, copy=False), int(rate)
