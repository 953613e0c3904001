"""The HTTP-library-free half both clients share: requests, answers, URL and headers, PCM cuts."""

from __future__ import annotations

import json

import pytest

from omni_client import APIError, OmniConnectionError, OmniError, OmniTimeoutError, protocol
from omni_client.errors import OmniUsageError, broken_off, cannot_connect, timed_out

pytestmark = pytest.mark.timeout(30)

NO_OPTIONS = {
    "voice": None,
    "speed": None,
    "seed": None,
    "instructions": None,
    "sample_rate": None,
}


def test_speech_request_sends_only_the_options_given() -> None:
    request = protocol.speech_request(
        "Hi.", model="tts-1", format="wav", stream=False, **NO_OPTIONS
    )
    assert (request.method, request.path) == ("POST", "/v1/audio/speech")
    assert request.json == {"model": "tts-1", "input": "Hi.", "response_format": "wav"}

    options = {"voice": "joe", "speed": 1.5, "seed": 0, "instructions": "", "sample_rate": 16000}
    streamed = protocol.speech_request("Hi.", model="m", format="pcm", stream=True, **options)
    # falsy values (seed 0, empty instructions) are sent: only None means "server default"
    assert streamed.json == {
        "model": "m",
        "input": "Hi.",
        "response_format": "pcm",
        **options,
        "stream_format": "audio",
    }


def test_discovery_requests_have_no_body() -> None:
    assert (protocol.MODELS.method, protocol.MODELS.path, protocol.MODELS.json) == (
        "GET",
        "/v1/models",
        None,
    )
    assert (protocol.HEALTH.method, protocol.HEALTH.path, protocol.HEALTH.json) == (
        "GET",
        "/health",
        None,
    )


def test_decode_json_names_what_came_instead() -> None:
    assert protocol.decode_json(b'{"data": [1]}', url="u", content_type=None) == {"data": [1]}
    for body in (b"<html>proxy error</html>", b"", b"\xff\xfe{"):
        with pytest.raises(OmniError, match=r"^http://h/v1/models: expected JSON, got text/html$"):
            protocol.decode_json(body, url="http://h/v1/models", content_type="text/html")


def test_api_error_from_openai_json_and_from_anything_else() -> None:
    body = {"error": {"message": "bad voice", "type": "invalid_request_error", "param": "voice"}}
    error = APIError.from_body(400, json.dumps(body).encode())
    assert (error.status, error.message, error.type, error.param, error.code) == (
        400,
        "bad voice",
        "invalid_request_error",
        "voice",
        None,
    )
    assert str(error) == "HTTP 400: bad voice" and error.is_client_error

    plain = APIError.from_body(502, b"  Bad Gateway from the proxy \n", "Bad Gateway")
    assert (plain.message, plain.type, plain.is_client_error) == (
        "Bad Gateway from the proxy",
        None,
        False,
    )
    assert APIError.from_body(503, b"", "Service Unavailable").message == "Service Unavailable"
    assert APIError.from_body(500, b'{"error": "flat"}').message == '{"error": "flat"}'


def test_transport_error_wording() -> None:
    timeout = timed_out("http://h", TimeoutError("slow"))
    assert isinstance(timeout, OmniTimeoutError) and isinstance(timeout, TimeoutError)
    assert str(timeout) == "http://h: timed out (TimeoutError)"
    refused = cannot_connect("http://h", OSError("refused"))
    assert (
        type(refused) is OmniConnectionError
        and str(refused) == "http://h: cannot connect (refused)"
    )
    broken = broken_off("http://h", "reset")
    assert type(broken) is OmniConnectionError
    assert str(broken) == "http://h: connection broken before the answer was complete (reset)"


def test_base_url_and_auth_headers_fall_back_to_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(protocol.URL_ENV, raising=False)
    monkeypatch.delenv(protocol.API_KEY_ENV, raising=False)
    assert protocol.base_url(None) == protocol.DEFAULT_URL
    assert protocol.auth_headers(None) == {}
    monkeypatch.setenv(protocol.URL_ENV, "https://env:9/")
    monkeypatch.setenv(protocol.API_KEY_ENV, "sk-env")
    assert protocol.base_url(None) == "https://env:9"
    assert protocol.base_url("http://given:1//") == "http://given:1"
    assert protocol.auth_headers(None) == {"Authorization": "Bearer sk-env"}
    assert protocol.auth_headers("") == {}, "an explicit empty key sends no header"
    with pytest.raises(OmniUsageError, match="must start with http"):
        protocol.base_url("localhost:8000")


def test_sample_aligner_never_splits_a_sample() -> None:
    aligner = protocol.SampleAligner()
    reads = [b"\x01", b"\x02\x03", b"", b"\x04\x05\x06\x07", b"\x08"]
    chunks = [aligner.feed(read) for read in reads]
    assert chunks == [b"", b"\x01\x02", b"", b"\x03\x04\x05\x06", b"\x07\x08"]
    aligner.finish()
    odd = protocol.SampleAligner()
    assert odd.feed(b"\x01\x02\x03") == b"\x01\x02"
    with pytest.raises(OmniError, match="mid-sample"):
        odd.finish()
