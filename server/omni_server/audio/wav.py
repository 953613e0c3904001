"""RIFF/WAVE headers for 16-bit PCM, sized or streaming.

A streamed WAV body is written before its length is known, so its header carries 0xFFFFFFFF in
both size fields (the RIFF chunk size and the `data` chunk size): the convention ffmpeg, sox and
browsers read as "until the end of the stream", and what OpenAI's streaming `wav` sends.
"""

from __future__ import annotations

import struct

STREAMING_SIZE = 0xFFFFFFFF
HEADER_BYTES = 44


def wav_header(
    sample_rate: int, *, channels: int = 1, sample_width: int = 2, data_bytes: int | None = None
) -> bytes:
    """The 44-byte header of a PCM WAV file; `data_bytes=None` gives the streaming header."""
    if data_bytes is None:
        riff_size = data_size = STREAMING_SIZE
    else:
        if data_bytes + HEADER_BYTES - 8 > STREAMING_SIZE:
            raise ValueError(f"{data_bytes} bytes of audio do not fit a RIFF file")
        riff_size, data_size = HEADER_BYTES - 8 + data_bytes, data_bytes
    block_align = channels * sample_width
    return (
        struct.pack("<4sI4s", b"RIFF", riff_size, b"WAVE")
        + struct.pack(
            "<4sIHHIIHH",
            b"fmt ",
            16,  # fmt chunk size for plain PCM
            1,  # WAVE_FORMAT_PCM
            channels,
            sample_rate,
            sample_rate * block_align,
            block_align,
            8 * sample_width,
        )
        + struct.pack("<4sI", b"data", data_size)
    )
