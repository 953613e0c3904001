"""Encoding float32 mono audio into an OpenAI `response_format` body, block by block.

`AudioEncoder` is fed consecutive blocks of one clip and hands back bytes:

- streaming=True: each `encode()` returns the bytes the muxer has produced so far, so a server
  can write them to the response at once. Containers are written to a non-seekable sink (nothing
  is rewritten later) with `flush_packets`, so no bytes wait in an I/O buffer; a codec with a
  frame size (mp3 1152, aac 1024, opus 20 ms) may hold back less than one frame until `finish()`,
  and Ogg (opus) up to one 100 ms page.
  WAV starts with the streaming header (sizes 0xFFFFFFFF); pcm is raw s16le.
- streaming=False: `encode()` returns b"" and `finish()` returns the whole file, written to a
  seekable buffer so the muxer can fill in lengths (a WAV with true sizes, FLAC STREAMINFO).
"""

from __future__ import annotations

import io
from typing import Any, Final

import av
import numpy as np

from omni_server.audio.wav import wav_header

FORMATS: Final = ("mp3", "opus", "aac", "flac", "wav", "pcm")

CONTENT_TYPES: Final = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",  # Opus in an Ogg container, as OpenAI sends it
    "aac": "audio/aac",  # ADTS frames
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}

# OpenAI's audio rate: its raw PCM, and every format of chat and realtime audio out.
OPENAI_SAMPLE_RATE: Final = 24_000

# Speech's output rate when a request names none. pcm carries no header, so it keeps OpenAI's
# 24 kHz contract; Opus cannot code 22.05 kHz and takes its nearest native rate. The others keep
# the voice's native rate (None) and say so in their header: no resampling work, no filter.
DEFAULT_SAMPLE_RATES: Final[dict[str, int | None]] = {
    "pcm": OPENAI_SAMPLE_RATE,
    "opus": OPENAI_SAMPLE_RATE,
    "mp3": None,
    "aac": None,
    "flac": None,
    "wav": None,
}

# (container, codec, sample format the codec takes) for the formats PyAV encodes.
_CODECS: Final = {
    "mp3": ("mp3", "libmp3lame", "s16p"),
    "opus": ("ogg", "libopus", "flt"),
    "aac": ("adts", "aac", "fltp"),
    "flac": ("flac", "flac", "s16"),
}
_RATES: Final = {
    "mp3": (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000),
    "opus": (8000, 12000, 16000, 24000, 48000),
    "aac": (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000),
}
_MIN_RATE, _MAX_RATE = 8000, 192_000  # wav, pcm, flac: any rate in this range
_BITRATES: Final = {"mp3": 64_000, "opus": 32_000, "aac": 64_000}  # mono speech


def default_sample_rate(response_format: str, native_rate: int) -> int:
    rate = DEFAULT_SAMPLE_RATES[response_format]
    return native_rate if rate is None else rate


def check_sample_rate(response_format: str, sample_rate: int) -> None:
    """Raise ValueError naming the valid rates when `response_format` cannot carry `sample_rate`."""
    if response_format not in FORMATS:
        raise ValueError(
            f"response_format must be one of {', '.join(FORMATS)}; got {response_format!r}"
        )
    rates = _RATES.get(response_format)
    if rates is not None and sample_rate not in rates:
        valid = ", ".join(str(r) for r in rates)
        raise ValueError(f"{response_format} supports sample rates {valid}; got {sample_rate}")
    if rates is None and not _MIN_RATE <= sample_rate <= _MAX_RATE:
        raise ValueError(
            f"{response_format} sample rate must lie in {_MIN_RATE}..{_MAX_RATE}; got {sample_rate}"
        )


def to_s16le(samples: np.ndarray) -> bytes:
    """float32 in [-1, 1] -> little-endian int16 bytes (clipped, scaled by 32767 like Piper)."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


class _Sink(io.RawIOBase):
    """A write-only, non-seekable file for the muxer; `take()` drains what it has written."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self._parts = b"".join(self._parts), []
        return out


class AudioEncoder:
    """One clip's encoder: `encode(block)`* then `finish()` once. Not thread-safe."""

    def __init__(
        self,
        response_format: str,
        sample_rate: int,
        *,
        streaming: bool,
        bit_rate: int | None = None,
    ) -> None:
        """`bit_rate` (bits/s) overrides the format's speech default (mp3, opus, aac only)."""
        check_sample_rate(response_format, sample_rate)
        self.format, self.sample_rate, self.streaming = response_format, sample_rate, streaming
        self._bit_rate = bit_rate or _BITRATES.get(response_format)
        self.samples = 0  # samples encoded so far
        self._finished = False
        self._pcm: list[bytes] = []  # non-streamed wav / pcm: the samples, joined at finish()
        self._container: Any = None  # av's OutputContainer for the codec formats
        if response_format in _CODECS:
            self._open_container()
        self._header = wav_header(sample_rate) if response_format == "wav" and streaming else b""

    def _open_container(self) -> None:
        container_format, codec, self._sample_format = _CODECS[self.format]
        self._out: _Sink | io.BytesIO = _Sink() if self.streaming else io.BytesIO()
        options = {"flush_packets": "1"} if self.streaming else {}
        if self.streaming and container_format == "ogg":
            # The Ogg muxer holds packets until a page spans page_duration (default 1 s);
            # 100 ms pages bound that hold-back at ~7% framing overhead for 32 kb/s speech.
            options["page_duration"] = "100000"
        self._container = av.open(
            self._out, mode="w", format=container_format, container_options=options
        )
        stream = self._container.add_stream(codec, rate=self.sample_rate, layout="mono")
        if self._bit_rate is not None:
            stream.bit_rate = self._bit_rate
        self._stream = stream

    def encode(self, samples: np.ndarray) -> bytes:
        """Encode the next block (float32 mono at `sample_rate`); returns the new bytes."""
        if self._finished:
            raise RuntimeError("encode() after finish()")
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        self.samples += len(samples)
        if self._container is None:  # wav, pcm: the body is the samples
            pcm = to_s16le(samples)
            if not self.streaming:
                self._pcm.append(pcm)
                return b""
            out, self._header = self._header + pcm, b""
            return out
        if len(samples):
            self._mux(self._frame(samples))
        return self._drain()

    def finish(self) -> bytes:
        """Flush codec and container; returns the last bytes (the whole file if not streaming)."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        if self._container is None:
            if not self.streaming:
                data = b"".join(self._pcm)
                if self.format == "pcm":
                    return data
                return wav_header(self.sample_rate, data_bytes=len(data)) + data
            out, self._header = self._header, b""  # a streamed wav with no samples at all
            return out
        self._mux(None)
        self._container.close()
        if self.streaming:
            return self._out.take()  # type: ignore[union-attr]
        return self._out.getvalue()  # type: ignore[union-attr]

    def close(self) -> None:
        """Release the codec without producing output (an aborted request)."""
        if self._container is not None and not self._finished:
            self._finished = True
            self._container.close()

    def _frame(self, samples: np.ndarray) -> av.AudioFrame:
        if self._sample_format.startswith("s16"):
            data = (np.clip(samples, -1.0, 1.0) * 32767.0).astype(np.int16)
            frame = av.AudioFrame.from_ndarray(
                data.reshape(1, -1), format=self._sample_format, layout="mono"
            )
        else:
            frame = av.AudioFrame.from_ndarray(
                samples.reshape(1, -1), format=self._sample_format, layout="mono"
            )
        frame.sample_rate = self.sample_rate
        return frame

    def _mux(self, frame: av.AudioFrame | None) -> None:
        for packet in self._stream.encode(frame):
            self._container.mux(packet)

    def _drain(self) -> bytes:
        return self._out.take() if self.streaming else b""  # type: ignore[union-attr]
