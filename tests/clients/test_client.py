"""`OmniClient` / `AsyncOmniClient` against a real omni-server."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from omni_client import (
    APIError,
    AsyncOmniClient,
    OmniClient,
    OmniConnectionError,
    OmniTimeoutError,
    OmniUsageError,
)
from omni_server.audio.decode import container_name, decode
from tests.clients.recording_server import RecordingServer
from tests.clients.texts import SENTENCES

pytestmark = pytest.mark.timeout(300)

# PyAV's container names for each response format
CONTAINERS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "opus": "ogg", "aac": "aac"}


@pytest.fixture
def client(server_url: str):
    with OmniClient(server_url) as client:
        yield client


def test_models_and_health(client: OmniClient) -> None:
    models = client.models()
    assert models, "the embedded repository serves at least one model"
    names = {m["id"] for m in models} | {a for m in models for a in m.get("aliases", [])}
    assert "tts-1" in names, f"the OpenAI alias is served: {sorted(names)}"
    assert all(m["object"] == "model" for m in models)
    assert isinstance(client.health(), dict)


@pytest.mark.parametrize("format", sorted(CONTAINERS))
def test_speech_bytes_decode_to_audio(client: OmniClient, format: str) -> None:
    body = client.speech("Hello from the client tests.", format=format, seed=1)
    assert container_name(body).split(",")[0] == CONTAINERS[format]
    audio = decode(body)
    assert 0.5 < audio.seconds < 10.0
    assert np.abs(audio.samples).max() > 0.05, "speech, not silence"


def test_pcm_is_24k_s16le(client: OmniClient) -> None:
    pcm = client.speech("Raw samples, please.", format="pcm", seed=1)
    audio = decode(pcm, "pcm", pcm_rate=24000)
    assert 0.5 < audio.seconds < 10.0
    assert np.abs(audio.samples).max() > 0.05, "speech, not silence"


def test_streamed_pcm_arrives_in_chunks_matching_the_whole(client: OmniClient) -> None:
    chunks = list(client.stream_pcm(SENTENCES, seed=42))
    assert len(chunks) >= 2, "one sentence after another, not one block at the end"
    assert all(len(c) % 2 == 0 and c for c in chunks), "chunks hold whole samples"
    whole = client.speech(SENTENCES, format="pcm", seed=42)
    assert b"".join(chunks) == whole


def test_speech_to_file_takes_the_format_from_the_extension(client: OmniClient, tmp_path) -> None:
    path = client.speech_to_file(tmp_path / "clip.flac", "A file from its extension.")
    assert container_name(path.read_bytes()) == "flac"
    with pytest.raises(OmniUsageError, match=r"\.xyz"):
        client.speech_to_file(tmp_path / "clip.xyz", "Which format is this?")


def test_server_errors_carry_the_openai_error(client: OmniClient) -> None:
    with pytest.raises(APIError) as caught:
        client.speech("Hello.", voice="no-such-voice")
    error = caught.value
    assert error.status == 400
    assert error.is_client_error
    assert "no-such-voice" in error.message
    assert error.type
    assert error.param == "voice"


def test_unreachable_server_is_a_connection_error(unreachable_url: str) -> None:
    with OmniClient(unreachable_url) as client, pytest.raises(OmniConnectionError):
        client.health()


def test_silent_server_times_out() -> None:
    with (
        RecordingServer(stall=True) as server,
        OmniClient(server.url, timeout=0.5) as client,
        pytest.raises(OmniTimeoutError),
    ):
        client.models()


def test_api_key_is_a_bearer_token_and_connections_are_reused() -> None:
    with RecordingServer() as server, OmniClient(server.url, api_key="sk-test") as client:
        for _ in range(3):
            assert client.models() == []
    assert [r.get("authorization") for r in server.requests] == ["Bearer sk-test"] * 3
    assert server.connections == 1, "keep-alive: three requests on one connection"


# -- async ---------------------------------------------------------------------------------------


async def test_async_stream_matches_the_sync_whole(server_url: str) -> None:
    async with AsyncOmniClient(server_url) as client:
        chunks = [chunk async for chunk in client.stream_pcm(SENTENCES, seed=42)]
        whole = await client.speech(SENTENCES, format="pcm", seed=42)
    assert len(chunks) >= 2
    assert b"".join(chunks) == whole
    with OmniClient(server_url) as sync_client:
        assert sync_client.speech(SENTENCES, format="pcm", seed=42) == whole


async def test_async_concurrent_requests(server_url: str) -> None:
    texts = ["First request.", "Second request.", "Third request."]
    async with AsyncOmniClient(server_url, max_connections=3) as client:
        clips = await asyncio.gather(*(client.speech(t, format="wav") for t in texts))
        models = await client.models()
        health = await client.health()
    assert all(decode(c).seconds > 0.3 for c in clips)
    assert models and isinstance(health, dict)


async def test_async_errors(server_url: str, unreachable_url: str) -> None:
    async with AsyncOmniClient(server_url) as client:
        with pytest.raises(APIError) as caught:
            await client.speech("Hello.", voice="no-such-voice")
    assert caught.value.status == 400
    async with AsyncOmniClient(unreachable_url) as client:
        with pytest.raises(OmniConnectionError):
            await client.models()
    with RecordingServer(stall=True) as server:
        async with AsyncOmniClient(server.url, timeout=0.5) as client:
            with pytest.raises(OmniTimeoutError):
                await client.models()
