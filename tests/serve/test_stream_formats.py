"""The text-in WebSocket's output formats (serve/stream_formats.py): ElevenLabs' names parsed,
and the session's encoder: G.711 equal to the realtime session's, MP3 one stream across chunks."""

from __future__ import annotations

import numpy as np
import pytest

from omni_server.audio import decode
from omni_server.serve.realtime.audio import PCMA, PCMU, Encoder
from omni_server.serve.stream_formats import OutputFormat, StreamEncoder, parse_output_format


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("pcm_24000", OutputFormat("pcm", 24000)),
        ("pcm_8000", OutputFormat("pcm", 8000)),
        ("mp3_44100_128", OutputFormat("mp3", 44100, 128)),  # ElevenLabs' SDK default
        ("mp3_44100", OutputFormat("mp3", 44100, 128)),  # their WebSocket page's default
        ("mp3_22050_32", OutputFormat("mp3", 22050, 32)),
        ("ulaw_8000", OutputFormat("ulaw", 8000)),
        ("alaw_8000", OutputFormat("alaw", 8000)),
    ],
)
def test_elevenlabs_names_parse(name, parsed):
    assert parse_output_format(name) == parsed


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("mp3_44100_100", "mp3_44100_128"),  # the valid mp3 formats are listed
        ("pcm_100", "8000..192000"),
        ("ulaw_16000", "ulaw_8000"),
        ("flac_44100", "pcm_24000"),
        ("pcm_24000_1", "pcm_24000"),
        (24000, "pcm_24000"),
    ],
)
def test_other_names_are_refused_saying_what_is_valid(name, says):
    with pytest.raises(ValueError, match=says):
        parse_output_format(name)


def _speech_like(rate: int, seconds: float) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    wave = 0.3 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 3 * t)
    return (wave * 32767).astype("<i2").tobytes()


@pytest.mark.parametrize("fmt", [PCMU, PCMA], ids=["ulaw", "alaw"])
def test_g711_is_the_realtime_sessions_encoding(fmt):
    pcm = _speech_like(8000, 0.5)
    codec = "ulaw" if fmt is PCMU else "alaw"
    ours = StreamEncoder(parse_output_format(f"{codec}_8000"))
    encoded = ours.encode(pcm[:1000]) + ours.encode(pcm[1000:]) + ours.finish()
    assert encoded == Encoder(fmt, in_rate=8000).encode(pcm)
    assert len(encoded) == len(pcm) // 2  # one byte a sample


def test_mp3_is_one_stream_across_chunks():
    pcm = _speech_like(44100, 2.0)
    encoder = StreamEncoder(parse_output_format("mp3_44100_128"))
    chunks = [encoder.encode(pcm[i : i + 8820]) for i in range(0, len(pcm), 8820)]
    chunks.append(encoder.finish())
    body = b"".join(chunks)
    assert body.count(b"ID3") == 1  # one header: the chunks concatenate into one file
    clip = decode(body, "mp3")
    assert clip.sample_rate == 44100
    assert abs(len(clip.samples) - 2 * 44100) < 2 * 1152  # the codec's padding, no more
    assert 100_000 < len(body) * 8 / 2.0 < 160_000  # about 128 kb/s
