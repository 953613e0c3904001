"""The audio formats of the text-in WebSocket (serve/speech_stream.py), named as ElevenLabs names
them in `output_format`, and the session's encoder.

    pcm_<rate>        PCM16 little-endian mono, 8000..192000 Hz (ElevenLabs: 8000, 16000, 22050,
                      24000, 44100, 48000)
    mp3_<rate>_<kbps> MP3 mono: mp3_22050_32, mp3_44100_32|64|96|128|192 (ElevenLabs' SDK default
                      is mp3_44100_128); mp3_44100 is 128 kb/s
    ulaw_8000         G.711 mu-law, 8 kHz (telephony: Twilio); alaw_8000 G.711 A-law

The voice is always asked for PCM16 at the format's rate (it resamples with soxr once); the
session encodes that. One encoder spans the whole session, so an MP3 stream is one stream across
sentences (no header or encoder padding between them): the client may concatenate the chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np

from omni_server.audio import AudioEncoder, check_sample_rate
from omni_server.serve.realtime.audio import alaw_encode, ulaw_encode

# mp3 (rate, kb/s) pairs ElevenLabs offers; the bare mp3_44100 of their WebSocket page is 128.
MP3_FORMATS: Final = {
    (22050, 32),
    (44100, 32),
    (44100, 64),
    (44100, 96),
    (44100, 128),
    (44100, 192),
}
MP3_DEFAULT_KBPS: Final = 128
G711_RATE: Final = 8000
EXAMPLES: Final = "pcm_24000, pcm_16000, mp3_44100_128, mp3_22050_32, ulaw_8000, alaw_8000"


@dataclass(frozen=True)
class OutputFormat:
    codec: str  # pcm | mp3 | ulaw | alaw
    rate: int
    kbps: int | None = None  # mp3 only

    @property
    def name(self) -> str:
        return f"{self.codec}_{self.rate}" + (f"_{self.kbps}" if self.kbps else "")


def parse_output_format(value: object) -> OutputFormat:
    """`pcm_24000`, `mp3_44100_128`, `ulaw_8000` ... -> its OutputFormat. Raises ValueError
    saying what is valid."""
    parts = value.split("_") if isinstance(value, str) else []
    if len(parts) in (2, 3) and all(p.isdigit() for p in parts[1:]):
        codec, rate = parts[0], int(parts[1])
        kbps = int(parts[2]) if len(parts) == 3 else None
        if codec == "pcm" and kbps is None:
            check_sample_rate("pcm", rate)  # ValueError naming the range
            return OutputFormat("pcm", rate)
        if codec == "mp3":
            kbps = MP3_DEFAULT_KBPS if kbps is None and rate == 44100 else kbps
            if (rate, kbps) in MP3_FORMATS:
                return OutputFormat("mp3", rate, kbps)
            valid = ", ".join(f"mp3_{r}_{k}" for r, k in sorted(MP3_FORMATS))
            raise ValueError(f"the mp3 formats are {valid}")
        if codec in ("ulaw", "alaw") and rate == G711_RATE and kbps is None:
            return OutputFormat(codec, rate)
    raise ValueError(f"the format is <codec>_<sample rate>[_<kb/s>], one of {EXAMPLES}")


class StreamEncoder:
    """The session's PCM16 (at the format's rate) -> the format's bytes, chunk by chunk.
    `encode` may hold back less than one MP3 frame (1152 samples); `finish` returns it."""

    def __init__(self, output: OutputFormat) -> None:
        self.output = output
        self._mp3 = (
            AudioEncoder("mp3", output.rate, streaming=True, bit_rate=output.kbps * 1000)
            if output.codec == "mp3" and output.kbps
            else None
        )

    def encode(self, pcm16: bytes) -> bytes:
        if self.output.codec == "pcm":
            return pcm16
        linear = np.frombuffer(pcm16[: len(pcm16) // 2 * 2], "<i2")
        if self._mp3 is not None:
            return self._mp3.encode(linear.astype(np.float32) / 32768.0)
        encode = ulaw_encode if self.output.codec == "ulaw" else alaw_encode
        return encode(linear.astype(np.int32)).tobytes()

    def finish(self) -> bytes:
        """The held-back tail; after it the stream is complete. Call once, at the end."""
        return self._mp3.finish() if self._mp3 is not None else b""

    def close(self) -> None:
        """Release the codec (the session ended without `finish`)."""
        if self._mp3 is not None:
            self._mp3.close()
