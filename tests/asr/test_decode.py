"""The decode stage: uploads of every container to 16 kHz mono, and what it refuses."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import pytest

from omni_bench.inprocess import load_stage
from omni_server.audio import containers
from omni_server.audio.encode import AudioEncoder
from omni_server.audio.wav import wav_header
from omni_server.backend import InvalidRequest, Request, StageConfigError


@pytest.fixture(scope="module")
def decoder(plan):
    return load_stage(plan, "asr_decode")


def _encode(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    encoder = AudioEncoder(fmt, rate, streaming=False)
    try:
        return encoder.encode(samples) + encoder.finish()
    finally:
        encoder.close()


def _tone(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def _run(decoder, data: bytes) -> dict:
    [out] = decoder.execute([Request(id="r", inputs={"file": data, "options": {"words": True}})])
    assert not isinstance(out, Exception), out
    return out


def _refusal(decoder, data: bytes) -> InvalidRequest:
    [out] = decoder.execute([Request(id="r", inputs={"file": data, "options": {}})])
    assert isinstance(out, InvalidRequest), out
    assert out.code == "invalid_audio" and out.param == "file"
    return out


@pytest.mark.parametrize(
    ("fmt", "rate"),
    [("wav", 44100), ("mp3", 24000), ("flac", 22050), ("opus", 48000), ("aac", 24000)],
)
def test_every_container_decodes_to_16k_mono(decoder, fmt, rate):
    out = _run(decoder, _encode(_tone(2.0, rate), rate, fmt))
    assert out["audio"].dtype == np.float32 and out["audio"].ndim == 1
    assert out["duration"] == pytest.approx(2.0, abs=0.1)  # codecs pad a frame or two
    assert out["audio"].size == pytest.approx(32000, abs=1600)
    assert out["options"] == {"words": True}  # passed on to the recognizer


def test_stereo_is_mixed_down(decoder):
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=16000, layout="stereo")
        left = _tone(1.0, 16000)
        interleaved = np.stack([left, -left], axis=1).reshape(1, -1)  # [1, 2 * samples]
        frame = av.AudioFrame.from_ndarray(
            (interleaved * 32767).astype(np.int16), format="s16", layout="stereo"
        )
        frame.sample_rate = 16000
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    out = _run(decoder, buffer.getvalue())
    assert np.abs(out["audio"]).max() < 0.01  # the channels cancel: a true mix, not one channel


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "empty"),
        (b"plain text, not audio at all\n" * 20, "could not be decoded"),
        (np.random.default_rng(0).bytes(4000), "could not be decoded"),
    ],
)
def test_not_audio_is_refused_as_the_callers_fault(decoder, data, says):
    assert says in _refusal(decoder, data).message


def test_a_truncated_flac_is_rejected(decoder):
    flac = _encode(_tone(3.0, 22050), 22050, "flac")
    _refusal(decoder, flac[: len(flac) // 2])


def test_audio_over_the_limit_is_rejected(plan):
    short = load_stage(plan, "asr_decode", parameters={"max_audio_seconds": 1})
    refusal = _refusal(short, _encode(_tone(2.0, 16000), 16000, "wav"))
    assert "longer than this server's limit of 1 s" in refusal.message


def test_a_missing_file_fails_the_request_as_a_server_fault(decoder):
    [out] = decoder.execute([Request(id="r", inputs={})])
    assert isinstance(out, ValueError) and not isinstance(out, InvalidRequest)


@pytest.mark.parametrize("limit", [0, -5, "long", True])
def test_a_bad_limit_is_a_config_error(plan, limit):
    with pytest.raises(StageConfigError, match="max_audio_seconds"):
        load_stage(plan, "asr_decode", parameters={"max_audio_seconds": limit})


def _wav_header_only(bits: int = 16, tag: int = 1, samples: int = 16000) -> bytes:
    """A WAV of silence whose fmt chunk says `bits` per sample and format `tag`."""
    pcm = bytes(samples * 2)
    return (
        struct.pack("<4sI4s", b"RIFF", 36 + len(pcm), b"WAVE")
        + struct.pack("<4sIHHIIHH", b"fmt ", 16, tag, 1, 16000, 32000, 2, bits)
        + struct.pack("<4sI", b"data", len(pcm))
        + pcm
    )


@pytest.mark.parametrize(("bits", "tag"), [(255, 1), (16, 0x1234), (0, 1)])
def test_a_wav_header_no_decoder_reads_is_invalid_audio(decoder, bits, tag):
    """The probe's 255 bits per sample and unknown format tag: FFmpeg opens them without a
    decoder (issue 27.5; was a 500 on a None codec)."""
    refusal = _refusal(decoder, _wav_header_only(bits, tag))
    assert "decod" in refusal.message


def _tone_file(fmt: str, rate: int = 24000, seconds: float = 3.0) -> bytes:
    return _encode(_tone(seconds, rate), rate, fmt)


def _webm_opus(seconds: float = 3.0) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="webm") as container:
        stream = container.add_stream("libopus", rate=48000, layout="mono")
        samples = (_tone(seconds, 48000) * 32767).astype(np.int16)
        for start in range(0, samples.size, 960):
            frame = av.AudioFrame.from_ndarray(
                samples[None, start : start + 960], format="s16", layout="mono"
            )
            frame.sample_rate = 48000
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


@pytest.mark.parametrize("fmt", ["wav", "mp3", "flac", "opus", "aac", "webm"])
def test_every_container_cut_short_is_invalid_audio(decoder, fmt):
    """A file that ends before its container says it does is refused, whatever the format
    (issue 27.6: a cut Ogg/Opus was heard in part with a 200)."""
    data = _webm_opus() if fmt == "webm" else _tone_file(fmt)
    assert _run(decoder, data)["duration"] == pytest.approx(3.0, abs=0.15)  # whole: heard
    for cut in (0.5, 0.8):
        refusal = _refusal(decoder, data[: int(len(data) * cut)])
        assert "truncated" in refusal.message or "could not be decoded" in refusal.message


def test_an_ogg_cut_at_a_page_boundary_is_truncated(decoder):
    """Every page whole, the last without the end-of-stream flag: cut, not short."""
    ogg = _tone_file("opus", 48000)
    pages = [i for i in range(len(ogg)) if ogg.startswith(b"OggS", i)]
    assert len(pages) > 3
    refusal = _refusal(decoder, ogg[: pages[-2]])
    assert "end-of-stream" in refusal.message


def test_decoded_audio_across_requests_is_bounded(plan):
    """Issue 27.9: the decoded samples this process holds, over every request, are at most
    max_total_audio_seconds; a request past it is refused (the endpoint's 429) and nothing is
    taken, and the budget comes back when the audio is freed."""
    stage = load_stage(
        plan, "asr_decode", parameters={"max_audio_seconds": 60, "max_total_audio_seconds": 90}
    )
    long_silence = _encode(np.zeros(50 * 16000, np.float32), 16000, "flac")
    first = _run(stage, long_silence)
    assert first["duration"] == pytest.approx(50.0, abs=0.1)
    assert stage.budget.held >= 50 * 16000
    [second] = stage.execute([Request(id="b", inputs={"file": long_silence, "options": {}})])
    assert isinstance(second, InvalidRequest) and second.code == "rate_limit_exceeded"
    assert "90 s across requests" in second.message
    held = stage.budget.held
    assert held < 60 * 16000  # the refused request took nothing
    del first  # the audio's last reference: its budget comes back
    assert stage.budget.held == 0
    assert _run(stage, long_silence)["duration"] == pytest.approx(50.0, abs=0.1)


def test_a_long_silent_flac_decodes_within_its_bound(decoder):
    """A 10-minute silent FLAC (the probe's was 29) decodes whole; the array is the audio's
    size (no joined copy of blocks)."""
    flac = _encode(np.zeros(600 * 16000, np.float32), 16000, "flac")
    out = _run(decoder, flac)
    assert out["duration"] == pytest.approx(600.0, abs=0.1)
    assert out["audio"].base is not None and out["audio"].base.size <= 601 * 16000


def test_a_total_below_the_per_request_limit_is_a_config_error(plan):
    with pytest.raises(StageConfigError, match="max_total_audio_seconds"):
        load_stage(
            plan, "asr_decode", parameters={"max_audio_seconds": 60, "max_total_audio_seconds": 30}
        )


def _extensible_wav(pcm: np.ndarray, rate: int) -> bytes:
    """The same mono PCM16 as WAVE_FORMAT_EXTENSIBLE (PCM subformat): FFmpeg's path reads it."""
    subformat = b"\x01\x00\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
    fmt = struct.pack("<HHIIHHHHI", 0xFFFE, 1, rate, 2 * rate, 2, 16, 22, 16, 4) + subformat
    body = pcm.astype("<i2").tobytes()
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(body))
    return b"RIFF" + struct.pack("<I", 4 + len(chunks) + len(body)) + b"WAVE" + chunks + body


@pytest.mark.parametrize("rate", [16000, 22050, 44100])
def test_a_plain_wav_decodes_to_what_ffmpeg_gives(decoder, rate):
    """Mono PCM16 WAVs skip FFmpeg (containers.plain_wav); the samples are FFmpeg's path's."""
    pcm = (_tone(1.3, rate) * 32767).astype(np.int16)
    plain = wav_header(rate, data_bytes=2 * pcm.size) + pcm.astype("<i2").tobytes()
    assert containers.plain_wav(plain) is not None
    assert containers.plain_wav(_extensible_wav(pcm, rate)) is None
    fast = _run(decoder, plain)["audio"]
    slow = _run(decoder, _extensible_wav(pcm, rate))["audio"]
    assert fast.dtype == slow.dtype == np.float32
    assert fast.shape == slow.shape
    np.testing.assert_allclose(fast, slow, atol=1e-6)


def test_only_a_whole_plain_wav_takes_the_short_path():
    pcm = (_tone(0.5, 16000) * 32767).astype(np.int16)
    plain = wav_header(16000, data_bytes=2 * pcm.size) + pcm.astype("<i2").tobytes()
    samples, rate = containers.plain_wav(plain)
    assert rate == 16000 and np.array_equal(samples, pcm)
    cut = plain[: len(plain) - 100]
    streaming = plain[:40] + struct.pack("<I", 0xFFFFFFFF) + plain[44:]
    eight_bit = plain[:34] + struct.pack("<H", 8) + plain[36:]
    two_channels = plain[:22] + struct.pack("<H", 2) + plain[24:]
    for data in (cut, streaming, eight_bit, two_channels, b"RIFF", plain[:44]):
        assert containers.plain_wav(data) is None


def test_a_cut_plain_wav_is_still_invalid_audio(decoder):
    plain = _encode(_tone(1.0, 16000), 16000, "wav")
    assert "truncated" in str(_refusal(decoder, plain[: len(plain) - 1000]))
