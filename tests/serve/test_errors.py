"""Every way a request can be wrong gets OpenAI's error JSON with the right status and field."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
from openai import OpenAI

from tests.serve.speech_texts import ONE_SENTENCE

pytestmark = pytest.mark.timeout(120)

GOOD = {"model": "tts-1", "voice": "alloy", "input": ONE_SENTENCE}


@pytest.mark.parametrize(
    ("change", "param", "says"),
    [
        ({"input": ""}, "input", "empty"),
        ({"input": "   "}, "input", "empty"),
        ({"input": "a" * 4097}, "input", "4096"),
        ({"response_format": "ogg"}, "response_format", "mp3, opus, aac, flac, wav, pcm"),
        ({"speed": 0.1}, "speed", "0.25"),
        ({"speed": 4.5}, "speed", "between 0.25 and 4; got 4.5"),
        ({"voice": "bob"}, "voice", "valid voices: joe, alloy"),
        ({"voice": {"name": "joe"}}, "voice", "object"),
        ({"stream_format": "chunks"}, "stream_format", "audio, sse"),
        ({"extra_body": {"stream": "yes"}}, "stream", "true or false"),
        ({"stream_format": "sse", "extra_body": {"stream": False}}, "stream", "one of them"),
        ({"extra_body": {"seed": "abc"}}, "seed", "integer"),
        ({"extra_body": {"sample_rate": 12345}, "response_format": "mp3"}, "sample_rate", "mp3"),
    ],
)
def test_invalid_field_is_400_naming_it(client: OpenAI, change: dict, param: str, says: str):
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.speech.create(**{**GOOD, **change})
    error = caught.value
    assert error.status_code == 400
    assert error.param == param
    assert error.type == "invalid_request_error"
    assert says in error.body["message"]


def test_unknown_fields_are_refused_as_openai_refuses_them(client: OpenAI):
    """A field no one declares (another server's `extra_body`) is OpenAI's 400, param and code
    null; the extensions docs/serving.md lists are not unknown."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.speech.create(**GOOD, extra_body={"some_other_servers_field": {"x": 1}})
    assert caught.value.body == {
        "message": "Unrecognized request argument supplied: some_other_servers_field",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    audio = client.audio.speech.create(
        **GOOD,
        response_format="pcm",
        extra_body={"seed": 3, "sample_rate": 16000, "stream": False},
    )
    assert audio.response.headers["X-Sample-Rate"] == "16000"
    assert "Content-Length" in audio.response.headers  # "stream": false, one whole body


def test_unknown_model_is_404_listing_served_models(client: OpenAI):
    with pytest.raises(openai.NotFoundError) as caught:
        client.audio.speech.create(**{**GOOD, "model": "no-such-model"})
    assert caught.value.code == "model_not_found"
    assert "piper-joe" in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, {}
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())["error"]


def test_malformed_json_is_400(server):
    status, error = post(server.url + "/v1/audio/speech", b'{"model": "tts-1", ')
    assert status == 400 and error["code"] == "invalid_json"
    status, error = post(server.url + "/v1/audio/speech", b'["a list"]')
    assert status == 400 and "JSON object" in error["message"]


def test_missing_input_is_400(server):
    status, error = post(server.url + "/v1/audio/speech", b'{"model": "tts-1", "voice": "joe"}')
    assert status == 400 and error["param"] == "input"


def test_speech_without_a_voice_is_400_naming_voice(server):
    # required as at OpenAI, though the embedded model has a default_voice: a client that
    # forgot it gets an error, not a voice it did not choose
    body = json.dumps({"model": "tts-1", "input": ONE_SENTENCE}).encode()
    status, error = post(server.url + "/v1/audio/speech", body)
    assert status == 400
    assert error["type"] == "invalid_request_error"
    assert (error["code"], error["param"]) == ("missing_required_parameter", "voice")
    assert error["message"] == "'voice' is required"


def test_oversize_body_is_413(server):
    body = json.dumps({**GOOD, "instructions": "x" * (2 << 20)}).encode()
    status, error = post(server.url + "/v1/audio/speech", body)
    assert status == 413 and error["code"] == "request_too_large"


def test_wrong_route_and_method_get_openai_json(server):
    status, body = server.get_json("/v1/no/such/route")
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body = server.get_json("/v1/audio/speech")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
