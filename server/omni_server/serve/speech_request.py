"""`POST /v1/audio/speech`: the body declared (`SpeechBody`: OpenAI's fields plus our extensions),
then what depends on the model and the options; the voice's options travel as the typed
`contracts.SpeechOptions`.

Every rejection is a 400 naming the field (`param`) and what would be valid; an unknown model is
a 404 listing the served ones; a field no one declares is refused as OpenAI refuses it
(serve/validation.py).
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

from pydantic import Field

from omni_server.audio import CONTENT_TYPES, DEFAULT_SAMPLE_RATES, FORMATS, check_sample_rate
from omni_server.compiler.plan import ModelSpec, Plan
from omni_server.contracts import (
    MAX_SEED,
    MAX_SPEECH_TEMPERATURE,
    MAX_SPEED,
    MIN_SPEED,
    SpeechOptions,
    speech_payload,
)
from omni_server.serve.errors import ApiError, invalid_field
from omni_server.serve.models import resolve_model
from omni_server.serve.options import ESTIMATE_CHARS_PER_SECOND, ServeOptions
from omni_server.serve.validation import (
    Between,
    Integer,
    RequestModel,
    Text,
    extension,
    model_name,
    parse,
)
from omni_server.serve.voice_catalog import Voice, VoiceCatalog, choose_voice

# Letters, numbers and symbols ("$", "%", emoji) are what a voice can say; an input of only
# punctuation, spaces, marks or invisible characters ("....", U+200B) has nothing to speak.
SPEAKABLE_CATEGORIES = frozenset("LNS")
PCM_SAMPLE_RATE = DEFAULT_SAMPLE_RATES["pcm"]  # OpenAI's pcm: 24 kHz, s16le, mono
ResponseFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
assert get_args(ResponseFormat) == FORMATS, "the encoder's formats are the ones declared"
StreamFormat = Literal["audio", "sse"]
STREAM_FORMATS: tuple[str, ...] = get_args(StreamFormat)
# OpenAI streams speech unless told otherwise: a request without `stream_format` gets "audio".
DEFAULT_STREAM_FORMAT: StreamFormat = "audio"


class SpeechBody(RequestModel):
    """The JSON body of `POST /v1/audio/speech`: OpenAI's fields, then our extensions."""

    model: str = Field(description="a model id or alias that serves speech")
    input: Text = Field(
        description="counted after NFKC normalization; must contain a letter, digit or symbol",
        json_schema_extra={"minLength": 1},
    )
    # required, as at OpenAI: a request without one is a 400 naming `voice`, never the
    # model's default_voice (a client that forgot it would hear a voice it did not choose)
    voice: Voice = Field(description="one of the model's voices or voice_aliases")
    instructions: Text | None = Field(
        None,
        description="how to speak; handed to the pipeline (Higgs Audio v2: the system message; "
        "the embedded Piper voice ignores it)",
    )
    response_format: ResponseFormat = "mp3"
    speed: Annotated[float, Between(MIN_SPEED, MAX_SPEED)] = 1.0
    stream_format: StreamFormat = DEFAULT_STREAM_FORMAT
    stream: bool | None = extension(
        "true: the default stream; false: one whole response with Content-Length (not with "
        "stream_format)"
    )
    seed: Annotated[Integer, Between(0, MAX_SEED)] | None = extension(
        "the same seed gives bit-identical audio"
    )
    temperature: Annotated[float, Between(0.0, MAX_SPEECH_TEMPERATURE)] | None = extension(
        "sampling temperature of a model that samples its audio (0: greedy); absent: the "
        "model's default; the embedded Piper voice ignores it"
    )
    sample_rate: Annotated[Integer, Between(1, 2**31 - 1)] | None = extension(
        "the output sample rate; the format must support it"
    )
    timestamps: bool | None = extension(
        "true: when each word and character plays. With stream_format sse: a "
        "speech.audio.word event per word; without stream_format (or with stream false): one "
        "JSON body, the audio in base64 with its alignment and words (ElevenLabs' "
        "with-timestamps). Not with stream_format audio (raw bytes carry no timing)"
    )


@dataclass(frozen=True)
class SpeechRequest:
    model: ModelSpec
    text: str
    stream_format: str | None  # None: one whole response with a Content-Length ("stream": false)
    options: SpeechOptions  # what the voice reads (the speech contract)
    timestamps: bool = False  # word timings: sse events, or the whole JSON form

    @property
    def response_format(self) -> str:
        return self.options.response_format

    @property
    def sample_rate(self) -> int | None:
        return self.options.sample_rate

    @property
    def content_type(self) -> str:
        return CONTENT_TYPES[self.response_format]

    def pipeline_inputs(self) -> dict[str, Any]:
        """The entry stage's inputs: the text and the typed speech contract."""
        return speech_payload(self.text, self.options)


def speech_model(body: Any, plan: Plan) -> ModelSpec:
    """The served model a speech request names: checked first, so errors can be counted by it."""
    return resolve_model(plan, model_name(body), task="speech")


def parse_speech_request(
    body: dict[str, Any],
    model: ModelSpec,
    options: ServeOptions | None = None,
    voices: VoiceCatalog | None = None,
) -> SpeechRequest:
    """The rest of the request, for the model `speech_model` found, within `options`' bounds;
    `voices` adds the custom voices (without it, the model's declared voices only)."""
    options = options or ServeOptions()
    fields = parse(SpeechBody, body)
    # `instructions` and `temperature` reach the entry stage beside the speech options; a
    # voice that cannot act on them (the embedded Piper voice) ignores them
    text = _input_text(fields.input, options.max_input_chars)
    _check_audio_estimate(text, fields.speed, options.max_audio_seconds)
    voice = choose_voice(fields.voice, model, voices, "voice")
    stream_format = _stream_format(fields)
    timestamps = bool(fields.timestamps)
    if timestamps and stream_format == "audio":
        if "stream_format" in fields.model_fields_set or fields.stream:
            raise invalid_field(
                "timestamps",
                "'timestamps': true needs stream_format 'sse' (a word event each) or no "
                "stream_format (one JSON body): raw audio bytes carry no timing",
            )
        stream_format = None  # the whole JSON form
    return SpeechRequest(
        model=model,
        text=text,
        stream_format=stream_format,
        timestamps=timestamps,
        options=SpeechOptions(
            voice=voice.name,
            reference=voice.reference,
            response_format=fields.response_format,
            stream=stream_format is not None,
            speed=fields.speed,
            timing=timestamps,
            seed=fields.seed,
            sample_rate=_sample_rate(fields.sample_rate, fields.response_format),
            instructions=fields.instructions,
            temperature=fields.temperature,
        ),
    )


def _input_text(sent: str, max_chars: int) -> str:
    """`input` in NFKC form, which is what the pipeline gets and what the bounds count: one
    character can expand to many (U+FDFA is 18 after NFKC), so counting before would let a
    short input buy far more work than its length says."""
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


def _stream_format(fields: SpeechBody) -> str | None:
    """How the body travels: "audio" (OpenAI's default), "sse", or None for one whole response.

    `stream` is an extension: `true` is SGLang-Omni's way to ask for a stream (a synonym of the
    default), `false` asks for the whole body with a Content-Length. It cannot contradict an
    explicit `stream_format`.
    """
    if fields.stream is False:
        if "stream_format" in fields.model_fields_set:
            raise invalid_field(
                "stream",
                f"'stream': false asks for one whole response, but 'stream_format' is "
                f"{fields.stream_format!r}; send one of them",
            )
        return None
    return fields.stream_format


def _sample_rate(rate: int | None, response_format: str) -> int | None:
    if rate is not None:
        try:
            check_sample_rate(response_format, rate)
        except ValueError as exc:
            raise invalid_field("sample_rate", f"'sample_rate': {exc}") from None
    return rate
