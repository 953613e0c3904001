"""The session's audio formats: 24 kHz PCM16, and G.711 mu-law / A-law at 8 kHz.

Input audio is decoded to float32 mono at its own rate; output audio (the voice's PCM16 at the
format's rate) is encoded to the session's output format. G.711 follows ITU-T G.711's segment tables
(the same bit patterns as `audioop.lin2ulaw` / `lin2alaw`), written with numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omni_server.audio.resample import StreamResampler

PCM_RATE = 24_000
G711_RATE = 8_000


@dataclass(frozen=True)
class AudioFormat:
    """One wire format: its GA type (`audio/pcm`, `audio/pcmu`, `audio/pcma`) and rate."""

    type: str
    rate: int

    @property
    def beta_name(self) -> str:
        return {"audio/pcm": "pcm16", "audio/pcmu": "g711_ulaw", "audio/pcma": "g711_alaw"}[
            self.type
        ]

    def ga(self) -> dict[str, object]:
        return (
            {"type": self.type, "rate": self.rate}
            if self.type == "audio/pcm"
            else {"type": self.type}
        )

    def bytes_per_second(self) -> int:
        return self.rate * (2 if self.type == "audio/pcm" else 1)


PCM16 = AudioFormat("audio/pcm", PCM_RATE)
PCMU = AudioFormat("audio/pcmu", G711_RATE)
PCMA = AudioFormat("audio/pcma", G711_RATE)
_BY_BETA = {f.beta_name: f for f in (PCM16, PCMU, PCMA)}
_BY_TYPE = {f.type: f for f in (PCM16, PCMU, PCMA)}


def parse_format(value: object) -> AudioFormat:
    """A format as a client gives it: GA `{"type": "audio/pcm", "rate": 24000}` or a beta
    name (`"pcm16"`, `"g711_ulaw"`, `"g711_alaw"`). Raises ValueError naming what is valid."""
    if isinstance(value, str) and value in _BY_BETA:
        return _BY_BETA[value]
    if isinstance(value, dict) and value.get("type") in _BY_TYPE:
        fmt = _BY_TYPE[str(value["type"])]
        rate = value.get("rate", fmt.rate)
        if rate != fmt.rate:
            raise ValueError(f"{fmt.type} is {fmt.rate} Hz here, got rate {rate!r}")
        return fmt
    raise ValueError(
        "expected {type: audio/pcm (rate 24000) | audio/pcmu | audio/pcma} or one of "
        f"{', '.join(_BY_BETA)}; got {value!r}"
    )


def decode(data: bytes, fmt: AudioFormat) -> np.ndarray:
    """Wire bytes -> float32 samples in [-1, 1] at fmt.rate. Raises ValueError on a torn
    PCM16 sample (an odd byte count)."""
    if fmt.type == "audio/pcm":
        if len(data) % 2:
            raise ValueError(f"PCM16 audio has an odd number of bytes ({len(data)})")
        return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0
    codes = np.frombuffer(data, np.uint8)
    table = _ULAW_TABLE if fmt.type == "audio/pcmu" else _ALAW_TABLE
    return table[codes]


class Encoder:
    """PCM16 at `in_rate` -> the session's output format, block by block. A response asks its
    voice for PCM16 at the format's own rate (`in_rate=fmt.rate`), so its audio is resampled
    once, by the voice's encoder; other rates are resampled here."""

    def __init__(self, fmt: AudioFormat, *, in_rate: int = PCM_RATE) -> None:
        self.format = fmt
        self._resampler = None if fmt.rate == in_rate else StreamResampler(in_rate, fmt.rate)

    def encode(self, pcm16: bytes) -> bytes:
        if self.format.type == "audio/pcm" and self._resampler is None:
            return pcm16
        samples = np.frombuffer(pcm16[: len(pcm16) // 2 * 2], "<i2").astype(np.float32) / 32768
        if self._resampler is not None:
            samples = self._resampler.push(samples)
        return _encoded(samples, self.format)

    def flush(self) -> bytes:
        if self._resampler is None:
            return b""
        return _encoded(self._resampler.flush(), self.format)


def _encoded(samples: np.ndarray, fmt: AudioFormat) -> bytes:
    linear = np.clip(np.round(samples * 32768.0), -32768, 32767).astype(np.int32)
    if fmt.type == "audio/pcm":
        return linear.astype("<i2").tobytes()
    return (ulaw_encode(linear) if fmt.type == "audio/pcmu" else alaw_encode(linear)).tobytes()


_ULAW_SEGMENT_ENDS = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_ALAW_SEGMENT_ENDS = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def ulaw_encode(x: np.ndarray) -> np.ndarray:
    """16-bit linear -> mu-law codes, on the 14-bit magnitude as G.711 defines it."""
    v = x >> 2
    negative = v < 0
    mask = np.where(negative, 0x7F, 0xFF)
    v = np.minimum(np.where(negative, -v, v), 8159) + 0x21
    segment = np.searchsorted(_ULAW_SEGMENT_ENDS, v)  # first end >= v
    code = (segment << 4) | ((v >> (segment + 1)) & 0x0F)
    return (np.where(segment >= 8, 0x7F, code) ^ mask).astype(np.uint8)


def alaw_encode(x: np.ndarray) -> np.ndarray:
    """16-bit linear -> A-law codes, on the 13-bit magnitude as G.711 defines it."""
    v = x >> 3
    negative = v < 0
    mask = np.where(negative, 0x55, 0xD5)
    v = np.where(negative, -v - 1, v)
    segment = np.searchsorted(_ALAW_SEGMENT_ENDS, v)
    low = np.where(segment < 2, v >> 1, v >> np.maximum(segment, 1)) & 0x0F
    code = (segment << 4) | low
    return (np.where(segment >= 8, 0x7F, code) ^ mask).astype(np.uint8)


def _ulaw_decode(code: np.ndarray) -> np.ndarray:
    code = ~code.astype(np.int32) & 0xFF
    sign = code & 0x80
    exponent = (code >> 4) & 0x07
    mantissa = code & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(sign, -magnitude, magnitude).astype(np.float32) / 32768.0


def _alaw_decode(code: np.ndarray) -> np.ndarray:
    code = code.astype(np.int32) ^ 0x55
    sign = code & 0x80
    exponent = (code >> 4) & 0x07
    mantissa = code & 0x0F
    magnitude = np.where(
        exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << (exponent - 1)
    )
    return np.where(sign, magnitude, -magnitude).astype(np.float32) / 32768.0


_CODES = np.arange(256, dtype=np.uint8)
_ULAW_TABLE = _ulaw_decode(_CODES)
_ALAW_TABLE = _alaw_decode(_CODES)
