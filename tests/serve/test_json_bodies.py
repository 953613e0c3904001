"""What a JSON route reads (issue 27.7 and 27.11): JSON only (415 for a form, text/plain or no
Content-Type), within the route's own limit (chat: 32 MiB, for base64 input audio; 413 past
it, declared or chunked), and every 503 says when to come back (`Retry-After`). In-process over
the stand-in voice (tests/serve/inline.py), through aiohttp's client: raw HTTP on a socket."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from omni_server.audio.wav import wav_header
from omni_server.serve.chat_request import MAX_BODY_BYTES as CHAT_BODY_BYTES
from omni_server.serve.errors import UNAVAILABLE_RETRY_AFTER_S
from tests.serve.inline import SPEECH

pytestmark = pytest.mark.timeout(120)


def _chat_with_audio(seconds: float, rate: int = 24_000) -> bytes:
    """A chat body with `seconds` of 16-bit mono wav as base64 input audio."""
    pcm = (np.zeros(int(seconds * rate)) * 32767).astype("<i2").tobytes()
    wav = wav_header(rate, data_bytes=len(pcm)) + pcm
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode()}}
    part["input_audio"]["format"] = "wav"
    body = {"model": "no-such-chat", "messages": [{"role": "user", "content": [part]}]}
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/audio/speech"])
async def test_a_body_not_sent_as_json_is_415(app_client, path, content_type):
    client = await app_client()
    response = await client.post(
        path, data=json.dumps(SPEECH).encode(), headers={"Content-Type": content_type}
    )
    assert response.status == 415
    error = (await response.json())["error"]
    assert error["code"] == "unsupported_media_type" and error["type"] == "invalid_request_error"
    assert "application/json" in error["message"]


async def test_a_body_without_content_type_is_415_and_json_is_served(app_client):
    client = await app_client()
    bare = await client.post(
        "/v1/audio/speech", data=json.dumps(SPEECH).encode(), skip_auto_headers=["Content-Type"]
    )
    assert bare.status == 415
    assert "no Content-Type" in (await bare.json())["error"]["message"]
    assert (await client.post("/v1/audio/speech", json=SPEECH)).status == 200
    suffixed = await client.post(
        "/v1/audio/speech",
        data=json.dumps(SPEECH).encode(),
        headers={"Content-Type": "application/vnd.api+json; charset=utf-8"},
    )
    assert suffixed.status == 200


async def test_a_chat_body_with_minutes_of_audio_is_read(app_client):
    """Five minutes of 24 kHz wav in base64 (19 MB) is well over the server's 1 MiB body
    limit and within chat's: the body is read and parsed (the model it names is then
    unknown: 404, not 413)."""
    client = await app_client()
    body = _chat_with_audio(300.0)
    assert 16 << 20 < len(body) < CHAT_BODY_BYTES
    response = await client.post(
        "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    assert response.status == 404, await response.text()
    assert "no-such-chat" in (await response.json())["error"]["message"]


async def test_a_chat_body_over_its_limit_is_413_declared_or_chunked(app_client):
    client = await app_client()
    body = _chat_with_audio(CHAT_BODY_BYTES / 48_000 * 0.76 + 10)  # base64: 4/3 of the wav
    assert len(body) > CHAT_BODY_BYTES
    headers = {"Content-Type": "application/json"}
    declared = await client.post("/v1/chat/completions", data=body, headers=headers)
    assert declared.status == 413
    assert (await declared.json())["error"]["code"] == "request_too_large"

    async def chunks():
        for start in range(0, len(body), 1 << 20):
            yield body[start : start + (1 << 20)]

    chunked = await client.post("/v1/chat/completions", data=chunks(), headers=headers)
    assert chunked.status == 413
    error = (await chunked.json())["error"]
    assert error["code"] == "request_too_large" and str(CHAT_BODY_BYTES) in error["message"]


async def test_a_speech_body_keeps_the_server_limit(app_client):
    client = await app_client(max_body_bytes=4096)

    async def chunks():
        yield b'{"model": "quiet", "input": "'
        yield b"a" * 8192
        yield b'"}'

    response = await client.post(
        "/v1/audio/speech", data=chunks(), headers={"Content-Type": "application/json"}
    )
    assert response.status == 413
    assert "4096" in (await response.json())["error"]["message"]


async def test_every_503_carries_retry_after(app_client, stand_in_runtime, monkeypatch):
    client = await app_client()
    # Stand-in for a dead stage process (the inline runtime has none to kill): the runtime's
    # own answer for a model whose process has no live replica. tests/pipeline kills real ones.
    monkeypatch.setattr(
        stand_in_runtime, "unavailable_for", lambda model: "no live replica of speaker"
    )
    response = await client.post("/v1/audio/speech", json=SPEECH)
    assert response.status == 503
    assert (await response.json())["error"]["code"] == "unavailable"
    assert response.headers["Retry-After"] == str(UNAVAILABLE_RETRY_AFTER_S)
    monkeypatch.undo()
    await stand_in_runtime.stop()
    stopped = await client.post("/v1/audio/speech", json=SPEECH)
    assert stopped.status == 503 and (await stopped.json())["error"]["code"] == "not_ready"
    assert stopped.headers["Retry-After"] == str(UNAVAILABLE_RETRY_AFTER_S)


def test_a_stage_at_its_work_bound_is_a_429_with_retry_after():
    """A stage's refusal with code rate_limit_exceeded (the ASR decoder holding all the
    decoded audio it allows, repository/asr_decode) is OpenAI's 429, as admission's; any
    other refusal stays a 400."""
    from omni_server.pipeline import PipelineError
    from omni_server.serve.pipeline_call import request_error

    busy = request_error(
        PipelineError("holding 3600 s", code="invalid_request", error_code="rate_limit_exceeded")
    )
    assert busy.status == 429 and busy.code == "rate_limit_exceeded"
    assert busy.type == "requests" and busy.headers == {"Retry-After": "1"}
    bad = request_error(
        PipelineError("no audio", code="invalid_request", error_code="invalid_audio", param="file")
    )
    assert bad.status == 400 and bad.code == "invalid_audio" and bad.param == "file"
