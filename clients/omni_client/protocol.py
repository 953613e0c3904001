"""What both clients share, apart from the HTTP library that sends it: defaults, the URL and
headers, the API's requests, the decoding of answers, whole PCM samples, formats and file
extensions."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_client.errors import OmniError, OmniUsageError

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "OMNI_SERVER_URL"
API_KEY_ENV = "OMNI_API_KEY"
DEFAULT_MODEL = "tts-1"  # the OpenAI alias every speech model of the embedded repository answers to
DEFAULT_TIMEOUT_S = 60.0

FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
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
    """One API call as the client sends it; each client hands it to its own HTTP library."""

    method: str
    path: str
    json: dict[str, Any] | None = None  # the JSON body; None sends no body


MODELS = Request("GET", "/v1/models")
HEALTH = Request("GET", "/health")


def speech_request(
    text: str,
    *,
    model: str,
    voice: str | None,
    format: str,
    speed: float | None,
    seed: int | None,
    instructions: str | None,
    sample_rate: int | None,
    stream: bool,
) -> Request:
    """`POST /v1/audio/speech`. Values are checked by the server, not here, so that every
    client gets the same error messages; options left at None are not sent."""
    body: dict[str, Any] = {"model": model, "input": text, "response_format": format}
    if voice is not None:  # else the model's default voice
        body["voice"] = voice
    if speed is not None:
        body["speed"] = speed
    if seed is not None:
        body["seed"] = seed
    if instructions is not None:
        body["instructions"] = instructions
    if sample_rate is not None:
        body["sample_rate"] = sample_rate
    if stream:
        body["stream_format"] = "audio"
    return Request("POST", "/v1/audio/speech", body)


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
