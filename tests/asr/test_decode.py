"""The decode stage: uploads of every container to 16 kHz mono, and what it refuses."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from omni_bench.inprocess import load_stage
from omni_server.audio.encode import AudioEncoder
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
