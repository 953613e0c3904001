"""Resampling with soxr (float32 mono), one-shot or across the blocks of one stream."""

from __future__ import annotations

import numpy as np
import soxr

QUALITY = "HQ"  # soxr's default high quality: transparent for speech, ~1 ms per second of audio


def resample(samples: np.ndarray, in_rate: int, out_rate: int) -> np.ndarray:
    """Resample a whole clip; returns the input unchanged when the rates match."""
    samples = np.asarray(samples, dtype=np.float32)
    if in_rate == out_rate:
        return samples
    return soxr.resample(samples, in_rate, out_rate, quality=QUALITY).astype(np.float32, copy=False)


class StreamResampler:
    """Resample consecutive blocks of one stream as if they were one clip (no seams).

    soxr keeps the filter state between blocks, so a block's output lags its input by the
    filter delay; `flush()` returns the tail once the stream has ended.
    """

    def __init__(self, in_rate: int, out_rate: int) -> None:
        self.in_rate, self.out_rate = in_rate, out_rate
        self._stream = (
            None
            if in_rate == out_rate
            else soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality=QUALITY)
        )

    def push(self, samples: np.ndarray) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.float32)
        if self._stream is None:
            return samples
        return self._stream.resample_chunk(samples, last=False)

    def flush(self) -> np.ndarray:
        if self._stream is None:
            return np.zeros(0, np.float32)
        return self._stream.resample_chunk(np.zeros(0, np.float32), last=True)
