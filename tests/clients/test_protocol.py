"""The I/O-free half both clients share: requests, answers, events, URL and headers, PCM cuts."""

from __future__ import annotations

import json

import pytest

from omni_client import (
    APIError,
    OmniConnectionError,
    OmniError,
    OmniTimeoutError,
    protocol,
    transport,
)
from omni_client.errors import OmniUsageError, broken_off, cannot_connect, timed_out

pytestmark = pytest.mark.timeout(30)

NO_OPTIONS = {
    "speed": None,
    "seed": None,
    "instructions": None,
    "sample_rate": None,
}


def test_speech_request_sends_only_the_options_given() -> None:
    request = protocol.speech_request(
        "Hi.", model="tts-1", voice="alloy", format="wav", stream=False, **NO_OPTIONS
    )
    assert (request.method, request.path) == ("POST", "/v1/audio/speech")
    # a whole body is asked for explicitly: the server's default is OpenAI's, a stream;
    # the voice always goes (the server requires one, as OpenAI does)
    assert request.json == {
        "model": "tts-1",
        "input": "Hi.",
        "voice": "alloy",
        "response_format": "wav",
        "stream": False,
    }

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


def test_transcription_form_sends_only_the_options_given(tmp_path) -> None:
    clip = tmp_path / "clip.flac"
    clip.write_bytes(b"fLaC...")
    request = protocol.transcription_request(
        clip, model="whisper-1", language=None, prompt=None, temperature=None,
        response_format="json", timestamp_granularities=None, stream=False,
    )  # fmt: skip
    assert (request.method, request.path, request.json) == (
        "POST",
        "/v1/audio/transcriptions",
        None,
    )
    assert request.form == [
        ("model", "whisper-1"),
        ("response_format", "json"),
        ("stream", "false"),
    ]
    assert request.files == {"file": ("clip.flac", b"fLaC...")}
    every = protocol.transcription_request(
        b"RIFF", model="m", language="en", prompt="", temperature=0, response_format="verbose_json",
        timestamp_granularities=("segment", "word"), stream=True, filename="x.wav",
    )  # fmt: skip
    assert every.form == [
        ("model", "m"),
        ("response_format", "verbose_json"),
        ("language", "en"),
        ("prompt", ""),
        ("temperature", "0.0"),
        ("timestamp_granularities[]", "segment"),
        ("timestamp_granularities[]", "word"),
        ("stream", "true"),
    ]
    assert every.files == {"file": ("x.wav", b"RIFF")}
    # httpx2 takes the repeated field as one name with a list
    assert transport.body(every)["data"]["timestamp_granularities[]"] == ["segment", "word"]
    assert transport.body(protocol.MODELS) == {}
    with pytest.raises(FileNotFoundError):
        protocol.transcription_request(
            tmp_path / "missing.wav", model="m", language=None, prompt=None, temperature=None,
            response_format="json", timestamp_granularities=None, stream=False,
        )  # fmt: skip


def test_transcripts_decode_by_format() -> None:
    ok = protocol.decode_transcript(b'{"text": "hi"}', "json", url="u", content_type=None)
    assert ok == {"text": "hi"}
    assert protocol.decode_transcript(
        "1\n00:00 h\u00e9\n".encode(), "srt", url="u", content_type=None
    ) == ("1\n00:00 h\u00e9\n")
    with pytest.raises(OmniError, match="without its 'text'"):
        protocol.decode_transcript(b'{"txt": 1}', "verbose_json", url="u", content_type=None)
    with pytest.raises(OmniError, match="not UTF-8"):
        protocol.decode_transcript(b"\xff\xfe", "text", url="u", content_type=None)


def test_sse_events_reassemble_events_split_anywhere() -> None:
    stream = (
        b": a comment\r\nevent: transcript.text.delta\r\n"
        b'data: {"type": "transcript.text.delta", "delta": "Hi"}\r\n\r\n'
        b'data: {"type": "transcript.text.done",\ndata: "text": "Hi"}\n\n'
    )
    for size in (1, 2, 7, len(stream)):
        events = protocol.SseEvents("u")
        got = [e for i in range(0, len(stream), size) for e in events.feed(stream[i : i + size])]
        events.finish()
        assert got == [
            {"type": "transcript.text.delta", "delta": "Hi"},
            {"type": "transcript.text.done", "text": "Hi"},
        ], size
    half = protocol.SseEvents("u")
    assert list(half.feed(b'data: {"type": "x"}\n')) == []
    with pytest.raises(OmniError, match="ended inside an event"):
        half.finish()
    for bad in (b"data: not json\n\n", b'data: {"delta": 1}\n\n'):
        with pytest.raises(OmniError):
            list(protocol.SseEvents("u").feed(bad))


def test_transcript_stream_needs_one_done_event_last() -> None:
    delta = {"type": protocol.TRANSCRIPT_DELTA, "delta": "a"}
    done = {"type": protocol.TRANSCRIPT_DONE, "text": "a"}
    whole = protocol.TranscriptStream("u")
    assert [whole.check(e) for e in (delta, done)] == [delta, done]
    whole.finish()
    with pytest.raises(OmniError, match=r"after transcript\.text\.done"):
        whole.check(delta)
    cut = protocol.TranscriptStream("u")
    cut.check(delta)
    with pytest.raises(OmniError, match=r"without transcript\.text\.done"):
        cut.finish()


def test_model_control_requests_are_tritons() -> None:
    index = protocol.repository_index(ready=True)
    assert (index.method, index.path, index.json) == (
        "POST",
        "/v2/repository/index",
        {"ready": True},
    )
    load = protocol.load_model("a b/c", {"stages.s.parameters.k": 2})
    assert load.path == "/v2/repository/models/a%20b%2Fc/load"  # a name is one path segment
    assert load.json == {"parameters": {"config": {"stages.s.parameters.k": 2}}}
    assert protocol.load_model("m").json == {}
    unload = protocol.unload_model("m", unload_dependents=True)
    assert unload.path == "/v2/repository/models/m/unload"
    assert unload.json == {"parameters": {"unload_dependents": True}}
