"""Whether an audio file ends where its container says it does (a cut upload is not a short one).

A decoder reads a cut file up to the cut without an error, so the check is the container's own
promise of its end, read from the bytes:

- Ogg (opus, vorbis, flac in ogg): every page is whole, and every logical stream's last page
  carries the end-of-stream flag. An encoder that finishes its file always writes that flag;
  a file cut anywhere lacks it (or ends inside a page).
- WAV (RIFF): the `data` chunk holds the bytes its size field declares (a streaming header's
  0xFFFFFFFF means "until the end" and promises nothing).
- Matroska / WebM: the Segment holds the bytes its size declares (a live writer's unknown size
  promises nothing).

Containers that declare a duration (flac's STREAMINFO, mp4's moov, matroska's Info) are also
checked by the decoder against what it decoded. MP3 promises nothing when it has no Xing/Info
header: one cut at a frame boundary is a shorter valid file (docs/asr.md).
"""

from __future__ import annotations

import struct

import numpy as np

OGG_CAPTURE = b"OggS"
OGG_HEADER = 27  # bytes before a page's segment table
OGG_EOS = 0x04
WAV_STREAMING_SIZE = 0xFFFFFFFF
EBML_MAGIC = b"\x1a\x45\xdf\xa3"
MATROSKA_SEGMENT = b"\x18\x53\x80\x67"


# A container that declares a duration but decodes to much less was cut short (a truncated
# wav, flac, m4a or webm decodes without an error up to the cut).
TRUNCATED_FRACTION = 0.9
TRUNCATED_SLACK_S = 0.2


def cut_short(
    data: bytes, container: str, declared_s: float | None, decoded_s: float
) -> str | None:
    """Why a file FFmpeg decoded to `decoded_s` seconds is incomplete, or None: its container
    declared `declared_s` (None: no duration) and it decoded to much less, or it ends before
    its container says it does (`truncation`). The one check of every upload that must be
    whole: transcription's (repository/asr_decode) and a custom voice's clip (serve/voices.py).
    """
    if declared_s is not None and decoded_s < declared_s * TRUNCATED_FRACTION - TRUNCATED_SLACK_S:
        return (
            f"it declares {declared_s:.2f} s of audio but only {decoded_s:.2f} s could be decoded"
        )
    return truncation(data, container)


def truncation(data: bytes, container: str) -> str | None:
    """Why `data` (a file FFmpeg named `container`, e.g. "ogg", "wav", "matroska,webm") ends
    before its container says it does, or None."""
    if container == "ogg":
        return _ogg(data)
    if container == "wav":
        return _wav(data)
    if "matroska" in container or "webm" in container:
        return _matroska(data)
    return None


def _ogg(data: bytes) -> str | None:
    pos, open_streams = 0, set[int]()
    while pos < len(data):
        if data[pos : pos + 4] != OGG_CAPTURE or pos + OGG_HEADER > len(data):
            if pos and not open_streams:
                return None  # bytes after every stream ended: not audio, nothing cut
            return f"byte {pos} of {len(data)} does not start a whole Ogg page"
        flags = data[pos + 5]
        (serial,) = struct.unpack_from("<I", data, pos + 14)
        segments = data[pos + 26]
        body = sum(data[pos + OGG_HEADER : pos + OGG_HEADER + segments])
        end = pos + OGG_HEADER + segments + body
        if end > len(data):
            return f"it ends inside an Ogg page (the page at byte {pos} needs {end} bytes)"
        if flags & OGG_EOS:
            open_streams.discard(serial)
        else:
            open_streams.add(serial)
        pos = end
    if open_streams:
        return "its Ogg stream has no end-of-stream page (the file was cut)"
    return None


def _wav(data: bytes) -> str | None:
    if data[:4] not in (b"RIFF", b"RF64") or data[8:12] != b"WAVE":
        return None
    pos = 12
    while pos + 8 <= len(data):
        chunk, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        if chunk == b"data":
            if size == WAV_STREAMING_SIZE or data[:4] == b"RF64":
                return None  # until the end (RF64 keeps the real size elsewhere)
            held = len(data) - pos - 8
            if held < size:
                return f"its data chunk declares {size} bytes but holds {held}"
            return None
        pos += 8 + size + (size & 1)  # chunks are padded to an even length
    return None


def _vint(data: bytes, pos: int) -> tuple[int, int, bool] | None:
    """An EBML variable-length size at `pos`: (value, its length, all ones = unknown size)."""
    if pos >= len(data) or data[pos] == 0:
        return None
    length = 9 - data[pos].bit_length()  # the leading zeros say how many bytes follow
    if pos + length > len(data):
        return None
    value = data[pos] & (0xFF >> length)
    for byte in data[pos + 1 : pos + length]:
        value = (value << 8) | byte
    return value, length, value == (1 << (7 * length)) - 1


def _matroska(data: bytes) -> str | None:
    if data[:4] != EBML_MAGIC:
        return None
    header = _vint(data, 4)
    if header is None:
        return None
    segment = 4 + header[1] + header[0]
    if data[segment : segment + 4] != MATROSKA_SEGMENT:
        return None
    size = _vint(data, segment + 4)
    if size is None or size[2]:
        return None  # an unknown size: a live stream's, "until the end"
    end = segment + 4 + size[1] + size[0]
    if end > len(data):
        return f"its Segment declares {end} bytes but the file has {len(data)}"
    return None


def plain_wav(data: bytes) -> tuple[np.ndarray, int] | None:
    """(int16 samples, rate) of a plain WAV: RIFF/WAVE, PCM (format tag 1), mono, 16 bits, its
    `data` chunk whole and sized; None for anything else (the caller decodes that with FFmpeg,
    which refuses what must be refused). Reading it here skips opening FFmpeg on the commonest
    upload (~8 ms a request, docs/benchmarks.md)."""
    if len(data) < 44 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    pos, rate = 12, None
    while pos + 8 <= len(data):
        chunk, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = pos + 8
        if chunk == b"fmt ":
            if size < 16 or body + 16 > len(data):
                return None
            tag, channels, rate_, _, align, bits = struct.unpack_from("<HHIIHH", data, body)
            if (tag, channels, align, bits) != (1, 1, 2, 16) or not 0 < rate_ <= 384_000:
                return None
            rate = rate_
        elif chunk == b"data":
            if rate is None or size == WAV_STREAMING_SIZE or size == 0 or size & 1:
                return None
            if body + size > len(data):
                return None  # cut short: FFmpeg's path says so, as for every container
            return np.frombuffer(data, dtype="<i2", count=size // 2, offset=body), rate
        pos = body + size + (size & 1)  # chunks are padded to an even length
    return None
