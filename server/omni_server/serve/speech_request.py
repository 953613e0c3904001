"""Validation of `POST /v1/audio/speech` bodies: the OpenAI fields plus our extensions.

Every rejection is a 400 naming the field (`param`) and what would be valid; an unknown model is
a 404 listing the served ones. Fields this server does not know are ignored, as OpenAI clients
send `extra_body` fields meant for other servers.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any

from omni_server.audio import CONTENT_TYPES, DEFAULT_SAMPLE_RATES, FORMATS, check_sample_rate
from omni_server.compiler.plan import ModelSpec, Plan
from omni_server.serve.errors import ApiError, invalid_field
from omni_server.serve.json_fields import (
    choice,
    integer,
    number,
    optional_str,
    required_str,
    valid_unicode,
)
from omni_server.serve.models import resolve_model
from omni_server.serve.options import ESTIMATE_CHARS_PER_SECOND, ServeOptions

# Letters, numbers and symbols ("$", "%", emoji) are what a voice can say; an input of only
# punctuation, spaces, marks or invisible characters ("....", U+200B) has nothing to speak.
SPEAKABLE_CATEGORIES = frozenset("LNS")
MIN_SPEED, MAX_SPEED = 0.25, 4.0
MAX_SEED = 2**63 - 1
PCM_SAMPLE_RATE = DEFAULT_SAMPLE_RATES["pcm"]  # OpenAI's pcm: 24 kHz, s16le, mono
STREAM_FORMATS = ("audio", "sse")
# OpenAI streams speech unless told otherwise: a request without `stream_format` gets "audio".
DEFAULT_STREAM_FORMAT = "audio"


@dataclass(frozen=True)
class SpeechRequest:
    model: ModelSpec
    text: str
    voice: str  # canonical: one of model.voices
    response_format: str
    speed: float
    stream_format: str | None  # None: one whole response with a Content-Length ("stream": false)
    seed: int | None
    sample_rate: int | None

    @property
    def content_type(self) -> str:
        return CONTENT_TYPES[self.response_format]

    def pipeline_inputs(self) -> dict[str, Any]:
        """The entry stage's inputs (the speech contract with the pipeline)."""
        return {
            "text": self.text,
            "voice": self.voice,
            "speed": self.speed,
            "seed": self.seed,
            "response_format": self.response_format,
            "stream": self.stream_format is not None,
            "sample_rate": self.sample_rate,
        }


def speech_model(body: Any, plan: Plan) -> ModelSpec:
    """The served model a speech request names: checked first, so errors can be counted by it."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    return resolve_model(plan, required_str(body, "model"), task="speech")


def parse_speech_request(
    body: dict[str, Any], model: ModelSpec, options: ServeOptions | None = None
) -> SpeechRequest:
    """The rest of the request, for the model `speech_model` found, within `options`' bounds."""
    options = options or ServeOptions()
    response_format = choice(body, "response_format", FORMATS, default="mp3")
    stream_format = _stream_format(body)
    # accepted and type-checked for OpenAI compatibility; the speech contract with the pipeline
    # has no instructions field yet, so no voice can act on them
    instructions = optional_str(body, "instructions")
    if instructions is not None:
        valid_unicode("instructions", instructions)
    speed = number(body, "speed", MIN_SPEED, MAX_SPEED, default=1.0)
    text = _input_text(body, options.max_input_chars)
    _check_audio_estimate(text, speed, options.max_audio_seconds)
    return SpeechRequest(
        model=model,
        text=text,
        voice=_voice(body, model),
        response_format=response_format,
        speed=speed,
        stream_format=stream_format,
        seed=integer(body, "seed", 0, MAX_SEED),
        sample_rate=_sample_rate(body, response_format),
    )


def _input_text(body: dict[str, Any], max_chars: int) -> str:
    """`input` in NFKC form, which is what the pipeline gets and what the bounds count: one
    character can expand to many (U+FDFA is 18 after NFKC), so counting before would let a
    short input buy far more work than its length says."""
    sent = valid_unicode("input", required_str(body, "input"))
    if len(sent) > max_chars:  # bounds the normalization's own work too
        raise _too_long(len(sent), max_chars)
    text = unicodedata.normalize("NFKC", sent)
    if len(text) > max_chars:
        raise _too_long(len(text), max_chars, sent=len(sent))
    if not text.strip():
        raise invalid_field("input", f"'input' is empty; give 1 to {max_chars} characters of text")
    if not any(unicodedata.category(c)[0] in SPEAKABLE_CATEGORIES for c in text):
        raise invalid_field(
            "input",
            "'input' has nothing to speak: no letters, digits or symbols, only punctuation, "
            "spaces or invisible characters",
        )
    return text


def _too_long(length: int, max_chars: int, sent: int | None = None) -> ApiError:
    counted = "" if sent is None else f" after Unicode NFKC normalization ({sent} as sent)"
    return invalid_field(
        "input",
        f"'input' has {length} characters{counted}; at most {max_chars} are allowed",
        code="string_above_max_length",
    )


def _check_audio_estimate(text: str, speed: float, max_seconds: float) -> None:
    """Refuse an input whose audio, estimated high, would run past `max_seconds`."""
    estimate = len(text) / (ESTIMATE_CHARS_PER_SECOND * speed)
    if estimate > max_seconds:
        longest = int(max_seconds * ESTIMATE_CHARS_PER_SECOND * speed)
        raise invalid_field(
            "input",
            f"'input' could make up to {estimate:.0f} s of audio at speed {speed:g} "
            f"(estimated at {ESTIMATE_CHARS_PER_SECOND:g} characters a second); at most "
            f"{max_seconds:g} s are allowed, so at this speed send at most {longest} characters",
            code="audio_above_max_length",
        )


def _stream_format(body: dict[str, Any]) -> str | None:
    """How the body travels: "audio" (OpenAI's default), "sse", or None for one whole response.

    `stream` is an extension: `true` is SGLang-Omni's way to ask for a stream (a synonym of the
    default), `false` asks for the whole body with a Content-Length. It cannot contradict an
    explicit `stream_format`.
    """
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid_field("stream", "'stream' must be true or false", code="invalid_type")
    stream_format = choice(body, "stream_format", STREAM_FORMATS, default=None)
    if stream is False:
        if stream_format is not None:
            raise invalid_field(
                "stream",
                f"'stream': false asks for one whole response, but 'stream_format' is "
                f"{stream_format!r}; send one of them",
            )
        return None
    return stream_format or DEFAULT_STREAM_FORMAT


def _voice(body: dict[str, Any], model: ModelSpec) -> str:
    raw = body.get("voice")
    if raw is None:
        if model.default_voice is None:
            raise invalid_field(
                "voice",
                f"'voice' is required; valid voices: {_voice_names(model)}",
                code="missing_required_parameter",
            )
        return model.default_voice
    if isinstance(raw, dict):
        raw = raw.get("id")
    if not isinstance(raw, str):
        raise invalid_field(
            "voice",
            "'voice' must be a voice name or an object {\"id\": name}",
            code="invalid_type",
        )
    if raw in model.voices:
        return raw
    if raw in model.voice_aliases:
        return model.voice_aliases[raw]
    raise invalid_field(
        "voice",
        f"unknown voice '{raw}' for model '{model.id}'; valid voices: {_voice_names(model)}",
    )


def _voice_names(model: ModelSpec) -> str:
    return ", ".join([*model.voices, *model.voice_aliases]) or "none"


def _sample_rate(body: dict[str, Any], response_format: str) -> int | None:
    rate = integer(body, "sample_rate", 1, 2**31 - 1)
    if rate is not None:
        try:
            check_sample_rate(response_format, rate)
        except ValueError as exc:
            raise invalid_field("sample_rate", f"'sample_rate': {exc}") from None
    return rate
