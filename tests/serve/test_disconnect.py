"""A client that leaves mid-stream aborts its request; the server stays healthy."""

from __future__ import annotations

import time

import pytest
from openai import OpenAI

from tests.helpers.metrics import samples, value
from tests.serve.speech_texts import MANY_SENTENCES, ONE_SENTENCE

pytestmark = pytest.mark.timeout(120)


def wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def disconnects(server) -> float:
    return value(
        samples(server.metrics()),
        "omni_request_failures_total",
        endpoint="speech",
        model="piper-joe",
        reason="client_disconnected",
    )


def test_leaving_mid_stream_aborts_the_request(server, client: OpenAI):
    before = disconnects(server)
    with client.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="alloy",
        input=MANY_SENTENCES,
        response_format="pcm",
        stream_format="audio",
    ) as response:
        first = next(response.iter_bytes())
        assert first
    # leaving the block closed the connection long before 24 sentences were synthesized
    assert wait_for(lambda: disconnects(server) == before + 1)
    assert wait_for(
        lambda: value(samples(server.metrics()), "omni_requests_in_flight", model="piper-joe") == 0
    )
    assert "aborted: client disconnected" in server.log()
    # the pipeline is free and healthy: the next request is served in full
    assert server.get_json("/health")[0] == 200
    audio = client.audio.speech.create(
        model="tts-1", voice="alloy", input=ONE_SENTENCE, response_format="wav"
    )
    assert audio.content[:4] == b"RIFF"
