"""The audio encoder stage and omni_server.audio: every format, streaming, WAV headers, pcm."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from omni_server.audio import (
    FORMATS,
    STREAMING_SIZE,
    AudioEncoder,
    StreamResampler,
    check_sample_rate,
    decode,
    resample,
    wav_header,
)

pytestmark = pytest.mark.timeout(300)

PARAGRAPH = "The sun rose over the hills. Birds began to sing. A new day had started."


@pytest.fixture(scope="module")
def reference_seconds(voice) -> float:
    """Duration of the paragraph's raw sentence audio, seed 21, before any encoding."""
    chunks = list(voice.sentences(voice.request(PARAGRAPH, seed=21)))
    return sum(len(c["audio"]) for c in chunks) / chunks[0]["sample_rate"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_decodes_to_the_synthesized_duration(voice, reference_seconds, fmt, stream):
    speech = voice.speak(PARAGRAPH, response_format=fmt, stream=stream, seed=21)
    expected_rate = {"pcm": 24000, "opus": 24000}.get(fmt, 22050)
    assert speech.result["format"] == fmt and speech.result["sentences"] == 3
    assert speech.result["sample_rate"] == expected_rate
    samples, rate = decode(speech.body, fmt, pcm_rate=expected_rate)
    seconds = len(samples) / rate
    # codec priming / padding adds at most a few frames (mp3 1152, aac 1024 samples)
    assert abs(seconds - reference_seconds) < 0.15, (seconds, reference_seconds)
    assert abs(speech.result["audio_seconds"] - reference_seconds) < 0.01
    assert np.sqrt(np.mean(samples**2)) > 0.02  # speech, not silence
    if stream:
        assert len(speech.chunks) >= 3  # bytes after every sentence, not one blob at the end
    else:
        assert len(speech.chunks) == 1


def test_streamed_wav_header_has_streaming_sizes(voice):
    speech = voice.speak("One. Two.", response_format="wav", stream=True, seed=1)
    first = speech.chunks[0]
    assert first[:4] == b"RIFF" and first[8:16] == b"WAVEfmt "
    riff_size = struct.unpack_from("<I", first, 4)[0]
    data_size = struct.unpack_from("<I", first, 40)[0]
    assert first[36:40] == b"data" and riff_size == data_size == STREAMING_SIZE
    channels, rate = struct.unpack_from("<HI", first, 22)
    assert (channels, rate) == (1, 22050)
    assert (len(speech.body) - 44) / 2 / 22050 == pytest.approx(speech.result["audio_seconds"])


def test_whole_wav_has_true_sizes(voice):
    body = voice.speak("One. Two.", response_format="wav", seed=1).body
    assert struct.unpack_from("<I", body, 4)[0] == len(body) - 8
    assert struct.unpack_from("<I", body, 40)[0] == len(body) - 44


def test_pcm_is_24khz_s16le_and_matches_resampled_audio(voice):
    speech = voice.speak("Raw samples please.", response_format="pcm", stream=True, seed=4)
    raw = np.concatenate(
        [c["audio"] for c in voice.sentences(voice.request("Raw samples please.", seed=4))]
    )
    assert len(speech.body) % 2 == 0
    pcm = np.frombuffer(speech.body, dtype="<i2")
    expected = np.clip(resample(raw, 22050, 24000), -1, 1) * 32767
    assert len(pcm) == len(expected)
    assert np.max(np.abs(pcm - expected.astype(np.int16))) <= 1
    assert speech.result["sample_rate"] == 24000


def test_requested_sample_rate_is_honoured(voice):
    speech = voice.speak("Sixteen kilohertz.", response_format="flac", sample_rate=16000, seed=2)
    samples, rate = decode(speech.body, "flac")
    assert rate == 16000 and speech.result["sample_rate"] == 16000
    assert len(samples) / rate == pytest.approx(speech.result["audio_seconds"], abs=0.01)


def test_stream_resampler_matches_one_shot_resampling():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(22050 * 2).astype(np.float32) * 0.1
    stream = StreamResampler(22050, 24000)
    parts = [
        stream.push(x[:7000]),
        stream.push(x[7000:30000]),
        stream.push(x[30000:]),
        stream.flush(),
    ]
    joined = np.concatenate(parts)
    whole = resample(x, 22050, 24000)
    assert abs(len(joined) - len(whole)) <= 2
    n = min(len(joined), len(whole)) - 100
    np.testing.assert_allclose(joined[100:n], whole[100:n], atol=1e-3)


def test_streamed_encoder_emits_bytes_before_finish():
    tone = (0.3 * np.sin(2 * np.pi * 220 * np.arange(24000) / 24000)).astype(np.float32)
    for fmt in FORMATS:
        encoder = AudioEncoder(fmt, 24000, streaming=True)
        early = encoder.encode(tone)  # one second of audio
        rest = encoder.finish()
        assert len(early) > len(rest), fmt
        samples, _ = decode(early + rest, fmt, pcm_rate=24000)
        assert len(samples) > 0


def test_wav_header_layout():
    header = wav_header(24000, data_bytes=100)
    assert len(header) == 44
    assert struct.unpack("<4sI4s4sIHHIIHH4sI", header) == (
        b"RIFF",
        136,
        b"WAVE",
        b"fmt ",
        16,
        1,
        1,
        24000,
        48000,
        2,
        16,
        b"data",
        100,
    )


@pytest.mark.parametrize(
    ("fmt", "rate", "message"),
    [
        ("opus", 22050, "opus supports sample rates 8000, 12000, 16000, 24000, 48000; got 22050"),
        ("mp3", 96000, "mp3 supports sample rates"),
        ("wav", 1000, "wav sample rate must lie in 8000..192000; got 1000"),
        ("ogg", 24000, "response_format must be one of mp3, opus, aac, flac, wav, pcm"),
    ],
)
def test_unsupported_sample_rates_are_refused_by_name(fmt, rate, message):
    with pytest.raises(ValueError, match=message):
        check_sample_rate(fmt, rate)


def test_pcm_and_wav_of_the_same_samples_decode_to_the_same_floats():
    """The one decoder scales raw pcm as FFmpeg scales s16 inside a container (1/32768)."""
    tone = (0.5 * np.sin(2 * np.pi * 330 * np.arange(4800) / 24000)).astype(np.float32)
    bodies = {}
    for fmt in ("pcm", "wav"):
        encoder = AudioEncoder(fmt, 24000, streaming=False)
        bodies[fmt] = encoder.encode(tone) + encoder.finish()
    pcm, wav = decode(bodies["pcm"], "pcm", pcm_rate=24000), decode(bodies["wav"], "wav")
    assert pcm.sample_rate == wav.sample_rate == 24000
    np.testing.assert_array_equal(pcm.samples, wav.samples)
    np.testing.assert_allclose(pcm.samples, tone, atol=1e-4)
