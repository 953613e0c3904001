"""`POST /v1/audio/speech` through the official openai client against a real server."""

from __future__ import annotations

import base64
import json
import struct

import numpy as np
import pytest
from openai import OpenAI

from omni_server.audio import decode
from tests.serve.speech_texts import ONE_SENTENCE, THREE_SENTENCES, plausible_seconds

pytestmark = pytest.mark.timeout(300)

FORMATS = ["mp3", "opus", "aac", "flac", "wav", "pcm"]
CONTENT_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}


def assert_plausible_speech(samples: np.ndarray, rate: int, text: str) -> None:
    seconds = len(samples) / rate
    low, high = plausible_seconds(text)
    assert low < seconds < high, f"{seconds:.2f} s of audio for {len(text.split())} words"
    assert float(np.abs(samples).max()) > 0.05, "the audio is silent"


@pytest.mark.parametrize("response_format", FORMATS)
def test_every_format_decodes_to_speech(client: OpenAI, response_format: str):
    # OpenAI's own names (model tts-1, voice alloy): examples written for OpenAI run unchanged.
    # `"stream": false` (our extension) asks for the whole body with its Content-Length.
    audio = client.audio.speech.create(
        model="tts-1",
        voice="alloy",
        input=ONE_SENTENCE,
        response_format=response_format,
        extra_body={"stream": False},
    )
    assert audio.response.headers["content-type"] == CONTENT_TYPES[response_format]
    assert int(audio.response.headers["content-length"]) == len(audio.content)
    assert "transfer-encoding" not in audio.response.headers
    samples, rate = decode(audio.content, response_format)
    assert_plausible_speech(samples, rate, ONE_SENTENCE)


@pytest.mark.parametrize("extra", [{}, {"stream": True}], ids=["default", "stream-true"])
def test_speech_streams_by_default_as_openai_does(client: OpenAI, extra: dict):
    # OpenAI's stream_format defaults to "audio"; SGLang-Omni's `stream: true` means the same
    with client.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="alloy",
        input=THREE_SENTENCES,
        response_format="pcm",
        extra_body={"seed": 21, **extra},
    ) as response:
        assert response.headers["transfer-encoding"] == "chunked"
        assert "content-length" not in response.headers
        chunks = [chunk for chunk in response.iter_bytes() if chunk]
    assert len(chunks) >= 2, "the whole body came in one piece"
    whole = client.audio.speech.create(
        model="tts-1",
        voice="alloy",
        input=THREE_SENTENCES,
        response_format="pcm",
        extra_body={"seed": 21, "stream": False},
    )
    assert b"".join(chunks) == whole.content  # the same audio, only the framing differs


def test_default_format_is_mp3_and_voice_may_be_an_object(client: OpenAI):
    audio = client.audio.speech.create(model="piper-joe", voice={"id": "joe"}, input=ONE_SENTENCE)
    assert audio.response.headers["content-type"] == "audio/mpeg"
    assert_plausible_speech(*decode(audio.content, "mp3"), ONE_SENTENCE)


def test_pcm_is_24khz_s16le_mono_and_says_so(client: OpenAI):
    audio = client.audio.speech.create(
        model="tts-1", voice="alloy", input=ONE_SENTENCE, response_format="pcm"
    )
    headers = audio.response.headers
    assert (headers["x-sample-rate"], headers["x-channels"], headers["x-bit-depth"]) == (
        "24000",
        "1",
        "16",
    )
    assert len(audio.content) % 2 == 0
    assert_plausible_speech(*decode(audio.content, "pcm", pcm_rate=24000), ONE_SENTENCE)


def test_sample_rate_extension_resamples_pcm(client: OpenAI):
    audio = client.audio.speech.create(
        model="tts-1",
        voice="alloy",
        input=ONE_SENTENCE,
        response_format="pcm",
        extra_body={"sample_rate": 16000, "seed": 7},
    )
    assert audio.response.headers["x-sample-rate"] == "16000"
    native = client.audio.speech.create(
        model="tts-1",
        voice="alloy",
        input=ONE_SENTENCE,
        response_format="pcm",
        extra_body={"seed": 7},
    )
    # the same seeded audio at two thirds of the rate: two thirds of the samples (+-1 block)
    assert abs(len(audio.content) / len(native.content) - 16000 / 24000) < 0.01


def test_speed_changes_length_not_rate(client: OpenAI):
    def seconds(speed: float) -> float:
        audio = client.audio.speech.create(
            model="tts-1",
            voice="alloy",
            input=THREE_SENTENCES,
            response_format="wav",
            speed=speed,
            extra_body={"seed": 3},
        )
        samples, rate = decode(audio.content, "wav")
        return len(samples) / rate

    normal, fast, slow = seconds(1.0), seconds(2.0), seconds(0.5)
    # proportional: 1 / speed within a frame a sentence (docs/voice.md, "Speed")
    assert fast / normal == pytest.approx(0.5, rel=0.02)
    assert slow / normal == pytest.approx(2.0, rel=0.02)


@pytest.mark.parametrize("response_format", ["pcm", "wav"])
def test_audio_stream_arrives_in_chunks(client: OpenAI, response_format: str):
    with client.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="alloy",
        input=THREE_SENTENCES,
        response_format=response_format,
        stream_format="audio",
    ) as response:
        assert response.headers["transfer-encoding"] == "chunked"
        assert "content-length" not in response.headers
        chunks = [chunk for chunk in response.iter_bytes() if chunk]
    # one sentence at a time: audio reaches the client before the last sentence is synthesized
    assert len(chunks) >= 2, "the whole body came in one piece"
    body = b"".join(chunks)
    if response_format == "wav":
        # the streaming header: RIFF and data sizes are unknown, written as 0xFFFFFFFF
        assert body[:4] == b"RIFF" and struct.unpack("<I", body[4:8])[0] == 0xFFFFFFFF
        assert struct.unpack("<I", body[40:44])[0] == 0xFFFFFFFF
    else:
        assert response.headers["x-sample-rate"] == "24000"
    assert_plausible_speech(*decode(body, response_format), THREE_SENTENCES)


def speech_stream(client: OpenAI, response_format: str, stream_format: str, seed: int):
    return client.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="alloy",
        input=THREE_SENTENCES,
        response_format=response_format,
        stream_format=stream_format,
        extra_body={"seed": seed},
    )


@pytest.mark.parametrize("response_format", ["pcm", "mp3"])
def test_sse_stream_sends_deltas_then_done(client: OpenAI, response_format: str):
    with speech_stream(client, response_format, "sse", seed=5) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = list(response.iter_lines())
    events = [json.loads(line[5:]) for line in lines if line.startswith("data:")]
    *deltas, done = events
    assert len(deltas) >= 2
    assert {event["type"] for event in deltas} == {"speech.audio.delta"}
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert usage["input_tokens"] == len(THREE_SENTENCES)
    assert usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    body = b"".join(base64.b64decode(event["audio"]) for event in deltas)
    # the deltas, joined, are exactly the body an audio stream of the same request sends
    with speech_stream(client, response_format, "audio", seed=5) as response:
        assert body == response.read()
    assert_plausible_speech(*decode(body, response_format), THREE_SENTENCES)


def test_instructions_are_accepted(client: OpenAI):
    audio = client.audio.speech.create(
        model="gpt-4o-mini-tts",
        voice="nova",
        input=ONE_SENTENCE,
        instructions="Speak in a cheerful tone.",
        response_format="flac",
    )
    assert_plausible_speech(*decode(audio.content, "flac"), ONE_SENTENCE)
