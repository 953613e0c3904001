"""Validating `POST /v1/audio/transcriptions`: OpenAI's multipart form, read within bounds
(serve/multipart.py), then parsed as declared (`TranscriptionForm`, which also gives the OpenAPI
document its schema); a field no one declares is refused as OpenAI refuses one
(serve/validation.py).

Every rejection is a 400 naming the field (`param`); 413 for an upload over the limit; an unknown
model is a 404 listing the served ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from omni_server.compiler.plan import ModelSpec, Plan
from omni_server.contracts import AsrOptions
from omni_server.serve.errors import invalid_field
from omni_server.serve.models import resolve_model
from omni_server.serve.multipart import Form
from omni_server.serve.validation import Between, RequestModel, parse

ResponseFormat = Literal["json", "text", "srt", "verbose_json", "vtt"]
RESPONSE_FORMATS: tuple[str, ...] = get_args(ResponseFormat)
LANGUAGES = ("en", "english")  # tiny.en hears English only


def _chunking_strategy(value: Any) -> Any:
    """OpenAI's `chunking_strategy`: "auto" (what this pipeline always does: its own voice
    activity detector cuts the audio), or a `server_vad` object, whose settings it cannot take."""
    if value == "auto":
        return value
    if isinstance(value, dict) and value.get("type") == "server_vad":
        raise PydanticCustomError(
            "unsupported_value",
            "'server_vad' is not supported: this pipeline cuts the audio by its own voice "
            "activity detector (Silero), whose settings a request cannot change; send 'auto' "
            "or leave it out",
        )
    raise PydanticCustomError(
        "invalid_value",
        "must be 'auto' or an object with type 'server_vad'; got {got}",
        {"got": repr(value)[:80]},
    )


def _form_boolean(value: Any) -> Any:
    """A form's boolean is the text true or false (pydantic's own would take "yes", "1", ...)."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise PydanticCustomError(
        "invalid_type", "must be true or false; got {got}", {"got": repr(value)}
    )


class TranscriptionForm(RequestModel):
    """The multipart form of `POST /v1/audio/transcriptions`. Its values arrive as text, so
    numbers are read from text (not strict); an array is its repeated `name[]` parts."""

    model_config = ConfigDict(strict=False, validate_by_name=True, loc_by_alias=False)

    file: bytes = Field(description="the audio, any container PyAV decodes; at most 25 MB")
    model: str = Field(description="a model id or alias that serves transcription")
    language: str | None = Field(None, description="en, or left out: this model hears English")
    prompt: str | None = Field(None, description="Whisper's initial prompt")
    response_format: ResponseFormat = "json"
    temperature: Annotated[float, Between(0.0, 1.0)] = 0.0
    timestamp_granularities: list[Literal["segment", "word"]] = Field(
        [], alias="timestamp_granularities[]", description="with verbose_json only"
    )
    # logprobs: Whisper's token log-probabilities (response_format json, as OpenAI's)
    include: list[Literal["logprobs"]] = Field([], alias="include[]")
    stream: Annotated[bool, BeforeValidator(_form_boolean)] = False
    chunking_strategy: Annotated[Any, AfterValidator(_chunking_strategy)] = Field(
        None,
        description="'auto' (or left out): the pipeline's own voice activity detector cuts the "
        "audio; a server_vad object is refused",
    )
    # accepted and not used: the pipeline tells no speakers apart
    known_speaker_names: list[str] = Field([], alias="known_speaker_names[]")
    known_speaker_references: list[str] = Field([], alias="known_speaker_references[]")


@dataclass(frozen=True)
class TranscriptionRequest:
    model: ModelSpec
    file: bytes
    filename: str | None
    prompt: str | None
    temperature: float
    response_format: str
    granularities: tuple[str, ...]
    stream: bool
    include: tuple[str, ...] = field(default=())

    @property
    def words(self) -> bool:
        """Word timings cost the recognizer an alignment pass: only when asked for."""
        return "word" in self.granularities

    @property
    def logprobs(self) -> bool:
        """Token log-probabilities cost the recognizer a scoring pass: only when asked for."""
        return "logprobs" in self.include

    def pipeline_inputs(self) -> dict[str, Any]:
        """The ASR entry's inputs: the file and the typed `contracts.AsrOptions`."""
        options = AsrOptions(
            prompt=self.prompt,
            temperature=self.temperature,
            words=self.words,
            logprobs=self.logprobs,
        )
        return options.payload(self.file)


def transcription_model(form: Form, plan: Plan) -> ModelSpec:
    """The served model the form names: checked first, so errors can be counted by it."""
    name = form.one("model")
    if not name:
        raise invalid_field("model", "'model' is required", code="missing_required_parameter")
    return resolve_model(plan, name, task="transcription")


def parse_transcription(form: Form, model: ModelSpec) -> TranscriptionRequest:
    fields = parse(TranscriptionForm, form.values(TranscriptionForm), form=True)
    _language(fields.language, model)
    if fields.include and fields.response_format != "json":
        raise invalid_field(
            "include",
            "'include[]' logprobs needs response_format json (as OpenAI's); got "
            f"{fields.response_format!r}",
            code="unsupported_value",
        )
    granularities = tuple(dict.fromkeys(fields.timestamp_granularities))
    if granularities and fields.response_format != "verbose_json":
        raise invalid_field(
            "timestamp_granularities",
            "'timestamp_granularities[]' needs response_format verbose_json",
        )
    return TranscriptionRequest(
        model=model,
        file=fields.file,
        filename=form.filename,
        prompt=fields.prompt,
        temperature=fields.temperature,
        response_format=fields.response_format,
        # verbose_json lists segments unless only words were asked for
        granularities=granularities
        or (("segment",) if fields.response_format == "verbose_json" else ()),
        stream=fields.stream,
        include=tuple(fields.include),
    )


def _language(language: str | None, model: ModelSpec) -> None:
    if language and language.strip().lower() not in LANGUAGES:
        raise invalid_field(
            "language",
            f"the model '{model.id}' transcribes English only; 'language' must be 'en' "
            f"(or left out), got {language!r}",
            code="unsupported_language",
        )
