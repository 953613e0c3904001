"""What both clients share, apart from sending it: defaults, the URL and headers, the API's
requests (speech, transcription, discovery, model control), the decoding of answers (JSON,
transcripts, SSE events), whole PCM samples, formats and file extensions. No I/O happens
here."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

from omni_client.errors import OmniError, OmniUsageError

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "OMNI_SERVER_URL"
API_KEY_ENV = "OMNI_API_KEY"
DEFAULT_MODEL = "tts-1"  # the OpenAI alias every speech model of the embedded repository answers to
DEFAULT_TRANSCRIPTION_MODEL = "whisper-1"  # likewise for its transcription model
# OpenAI's voice name the embedded repository maps onto its voice; the server requires a voice,
# as OpenAI does, so the client always sends one
DEFAULT_VOICE = "alloy"
DEFAULT_TIMEOUT_S = 60.0

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
TRANSCRIPT_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
JSON_TRANSCRIPTS = ("json", "verbose_json")  # answered as JSON objects; the others as text
GRANULARITIES = ("segment", "word")
# the streamed transcription's events (OpenAI's): deltas, then one done event carrying the text
TRANSCRIPT_DELTA = "transcript.text.delta"
TRANSCRIPT_DONE = "transcript.text.done"
# raw PCM as the server streams it unless `sample_rate` asks otherwise: s16le, mono
PCM_SAMPLE_RATE = 24000

_EXTENSIONS = {
    ".mp3": "mp3",
    ".opus": "opus",
    ".ogg": "opus",
    ".aac": "aac",
    ".flac": "flac",
    ".wav": "wav",
    ".pcm": "pcm",
    ".raw": "pcm",
}


def base_url(url: str | None) -> str:
    """The explicit URL, else $OMNI_SERVER_URL, else the server's default address."""
    chosen = (url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
    if not chosen.startswith(("http://", "https://")):
        raise OmniUsageError(f"server URL must start with http:// or https://, got {chosen!r}")
    return chosen


def auth_headers(api_key: str | None) -> dict[str, str]:
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


def format_for_path(path: str | os.PathLike[str]) -> str:
    """The response format a file name asks for: `clip.wav` -> `wav`."""
    suffix = Path(path).suffix.lower()
    try:
        return _EXTENSIONS[suffix]
    except KeyError:
        known = ", ".join(sorted(_EXTENSIONS))
        raise OmniUsageError(
            f"cannot tell the audio format from {os.fspath(path)!r}: "
            f"use one of the extensions {known} or pass the format explicitly"
        ) from None


@dataclass(frozen=True)
class Request:
    """One API call as the client sends it: a JSON body, a multipart form, or no body."""

    method: str
    path: str
    json: dict[str, Any] | None = None  # the JSON body
    form: list[tuple[str, str]] = field(default_factory=list)  # multipart text fields, in order
    files: dict[str, tuple[str, bytes | IO[bytes]]] | None = None  # multipart: name -> file


MODELS = Request("GET", "/v1/models")
HEALTH = Request("GET", "/health")


# Triton's model repository API (server: --model-control-mode explicit for load / unload)
def repository_index(*, ready: bool = False) -> Request:
    return Request("POST", "/v2/repository/index", json={"ready": ready})


def load_model(name: str, config: dict[str, Any] | None = None) -> Request:
    """Load or reload `name`; `config`: dotted repository fields -> values for this load."""
    body: dict[str, Any] = {"parameters": {"config": config}} if config else {}
    return Request("POST", f"/v2/repository/models/{quote(name, safe='')}/load", json=body)


def unload_model(name: str, *, unload_dependents: bool = False) -> Request:
    body = {"parameters": {"unload_dependents": unload_dependents}}
    return Request("POST", f"/v2/repository/models/{quote(name, safe='')}/unload", json=body)


def speech_request(
    text: str,
    *,
    model: str,
    voice: str,
    format: str,
    speed: float | None,
    seed: int | None,
    instructions: str | None,
    sample_rate: int | None,
    stream: bool,
    timestamps: bool = False,
) -> Request:
    """`POST /v1/audio/speech`. Values are checked by the server, not here, so that every
    client gets the same error messages; options left at None are not sent. `timestamps`
    with `stream`: server-sent events, the audio's deltas and a `speech.audio.word` event per
    word (the server's extension)."""
    body: dict[str, Any] = {
        "model": model,
        "input": text,
        "voice": voice,
        "response_format": format,
    }
    if speed is not None:
        body["speed"] = speed
    if seed is not None:
        body["seed"] = seed
    if instructions is not None:
        body["instructions"] = instructions
    if sample_rate is not None:
        body["sample_rate"] = sample_rate
    # Said explicitly either way (OpenAI streams by default): a stream of raw body bytes as they
    # are synthesized, or one whole body with a Content-Length, whose failure is a proper 5xx.
    if timestamps:
        body["timestamps"] = True
    if stream:
        body["stream_format"] = "sse" if timestamps else "audio"
    else:
        body["stream"] = False
    return Request("POST", "/v1/audio/speech", body)


WORD_EVENT = "speech.audio.word"  # the server's extension: {"word", "start", "end"} (seconds)
AUDIO_DELTA = "speech.audio.delta"
AUDIO_DONE = "speech.audio.done"


AudioFile = str | os.PathLike[str] | bytes | IO[bytes]


def transcription_request(
    file: AudioFile,
    *,
    model: str,
    language: str | None,
    prompt: str | None,
    temperature: float | None,
    response_format: str,
    timestamp_granularities: tuple[str, ...] | list[str] | None,
    stream: bool,
    filename: str | None = None,
) -> Request:
    """`POST /v1/audio/transcriptions`, OpenAI's multipart form. `file` is a path, the bytes
    of an audio file, or a binary file object (read by the HTTP library as it sends). As for
    speech, values are checked by the server; options left at None are not sent."""
    form = [("model", model), ("response_format", response_format)]
    if language is not None:
        form.append(("language", language))
    if prompt is not None:
        form.append(("prompt", prompt))
    if temperature is not None:
        form.append(("temperature", repr(float(temperature))))
    form += [("timestamp_granularities[]", g) for g in timestamp_granularities or ()]
    form.append(("stream", "true" if stream else "false"))
    if isinstance(file, str | os.PathLike):
        path = Path(file)
        content: bytes | IO[bytes] = path.read_bytes()  # OSError names the file
        name = filename or path.name
    else:
        content = file
        name = filename or Path(getattr(file, "name", None) or "audio").name
    return Request("POST", "/v1/audio/transcriptions", form=form, files={"file": (name, content)})


def decode_transcript(
    body: bytes, response_format: str, *, url: str, content_type: str | None
) -> dict[str, Any] | str:
    """A whole transcription answer: the JSON object of `json` / `verbose_json`, else the text
    (`text`, `srt`, `vtt`) as the server wrote it."""
    if response_format in JSON_TRANSCRIPTS:
        transcript = decode_json(body, url=url, content_type=content_type)
        if not isinstance(transcript, dict) or not isinstance(transcript.get("text"), str):
            raise OmniError(f"{url}: a {response_format} transcript without its 'text'")
        return transcript
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OmniError(f"{url}: a {response_format} transcript that is not UTF-8") from e


class SseEvents:
    """Server-sent events of a byte stream, as JSON objects (the `data:` of each event).

    Fed network reads of any size; `feed` returns the events completed so far. A stream whose
    last event is incomplete is cut off, which `finish` reports."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._buffer = b""
        self._data: list[bytes] = []

    def feed(self, data: bytes) -> Iterator[dict[str, Any]]:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r")
            if not line:  # a blank line ends an event
                if self._data:
                    yield self._event(b"\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data:"):
                self._data.append(line[5:].removeprefix(b" "))
            # `event:`, `id:`, `retry:` and `:` comments carry nothing the JSON does not

    def finish(self) -> None:
        if self._data or self._buffer.strip():
            raise OmniError(f"{self._url}: the event stream ended inside an event")

    def _event(self, data: bytes) -> dict[str, Any]:
        try:
            event = json.loads(data)
        except ValueError as e:
            raise OmniError(f"{self._url}: an event that is not JSON: {data[:200]!r}") from e
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise OmniError(f"{self._url}: an event without a 'type': {data[:200]!r}")
        return event


class TranscriptStream:
    """Checks a streamed transcription's events: deltas, then exactly one done event last.

    A stream that ends without `transcript.text.done` failed on the server (it cuts the stream
    rather than finish it): `finish` raises, so a caller never takes a partial text as whole."""

    def __init__(self, url: str) -> None:
        self._url = url
        self.done: dict[str, Any] | None = None

    def check(self, event: dict[str, Any]) -> dict[str, Any]:
        if self.done is not None:
            raise OmniError(f"{self._url}: an event after {TRANSCRIPT_DONE}: {event['type']}")
        if event["type"] == TRANSCRIPT_DONE:
            self.done = event
        return event

    def finish(self) -> None:
        if self.done is None:
            raise OmniError(
                f"{self._url}: the transcript stream ended without {TRANSCRIPT_DONE} "
                "(the transcription failed on the server)"
            )


def decode_json(body: bytes, *, url: str, content_type: str | None) -> Any:
    """The JSON of a successful answer; anything else (say, a proxy's HTML page) is an error
    that names what came instead."""
    try:
        return json.loads(body)
    except ValueError as e:  # also UnicodeDecodeError, and an empty body
        raise OmniError(f"{url}: expected JSON, got {content_type}") from e


class SampleAligner:
    """Cuts a byte stream at whole s16 samples: a network read may end mid-sample, and a
    consumer converting each chunk to int16 must never see half of one."""

    def __init__(self) -> None:
        self._carry = b""

    def feed(self, data: bytes) -> bytes:
        data = self._carry + data
        whole = len(data) - len(data) % 2
        self._carry = data[whole:]
        return data[:whole]

    def finish(self) -> None:
        if self._carry:
            raise OmniError("PCM stream ended mid-sample (odd number of bytes)")  # server fault
