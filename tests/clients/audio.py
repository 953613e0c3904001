"""Decode what the server sent with PyAV: proof that bytes are real audio, not just bytes."""

from __future__ import annotations

import io
from dataclasses import dataclass

import av
import numpy as np


@dataclass
class Decoded:
    container: str  # PyAV's format name, e.g. "wav", "mp3", "ogg"
    sample_rate: int
    channels: int
    samples: np.ndarray  # float32, first channel

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate


def decode(data: bytes) -> Decoded:
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        channels = stream.codec_context.channels
        firsts = [_first_channel(frame, channels) for frame in container.decode(stream)]
        rate = stream.codec_context.sample_rate
        name = container.format.name
    return Decoded(name, rate, channels, np.concatenate(firsts))


def _first_channel(frame: av.AudioFrame, channels: int) -> np.ndarray:
    array = frame.to_ndarray()  # planar: [channels, n]; packed: [1, n * channels]
    first = array[0] if frame.format.is_planar else array.reshape(-1, channels)[:, 0]
    if np.issubdtype(first.dtype, np.integer):
        return first.astype(np.float32) / np.iinfo(first.dtype).max
    return first.astype(np.float32)


def pcm_samples(data: bytes) -> np.ndarray:
    assert len(data) % 2 == 0, "raw PCM must hold whole s16 samples"
    return np.frombuffer(data, dtype="<i2")
