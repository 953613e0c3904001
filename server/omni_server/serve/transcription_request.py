"""Reading and validating `POST /v1/audio/transcriptions`: OpenAI's multipart form, bounded.

The body is read part by part as it arrives, never whole: a Content-Length over the limit is
refused before a byte is read, and the file part's bytes are counted while they stream in, so an
upload without a length (chunked) is cut off at the limit too. Every other part is a small text
field with its own bound. The fields are then parsed as declared (`TranscriptionForm`, which
also gives the OpenAPI document its schema); a field no one declares is refused as OpenAI
refuses one (serve/validation.py).

Every rejection is a 400 naming the field (`param`); 413 for an upload over the limit; an unknown
model is a 404 listing the served ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, get_args, get_origin

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from omni_server.compiler.plan import ModelSpec, Plan
from omni_server.serve.errors import ApiError, invalid_field
from omni_server.serve.models import resolve_model
from omni_server.serve.validation import Between, RequestModel, parse

MAX_FILE_BYTES = 25 * 1024 * 1024  # OpenAI's upload limit: 25 MB
MAX_FIELD_BYTES = 64 * 1024  # a text field (the prompt is the longest: Whisper reads 224 tokens)
MAX_PARTS = 64
MAX_PART_HEADERS = 16  # a form part has two or three (Content-Disposition, Content-Type)
MAX_HEADER_LINE = 8190  # aiohttp's line limit for a part header
MAX_FILENAME_CHARS = 1024
FORM_OVERHEAD_BYTES = 1024 * 1024  # boundaries, part headers and the text fields around the file
READ_CHUNK = 64 * 1024

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


_ARRAYS = frozenset(
    name for name, f in TranscriptionForm.model_fields.items() if get_origin(f.annotation) is list
)


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
        inputs = asr_inputs(
            self.file, prompt=self.prompt, temperature=self.temperature, words=self.words
        )
        if self.logprobs:
            inputs["options"]["logprobs"] = True
        return inputs


def asr_inputs(
    file: bytes, *, prompt: str | None = None, temperature: float = 0.0, words: bool = False
) -> dict[str, Any]:
    """The ASR entry stage's inputs: the transcription contract with the pipeline (docs/asr.md),
    for every endpoint that hears audio."""
    return {"file": file, "options": {"prompt": prompt, "temperature": temperature, "words": words}}


@dataclass
class Form:
    """What the multipart body held: text fields (lists, for `name[]` fields) and the file."""

    fields: dict[str, list[str]] = field(default_factory=dict)
    file: bytes | None = None
    filename: str | None = None
    file_part: str = "file"  # the name the file part had (a voice's clip: `audio_sample`)

    def one(self, name: str) -> str | None:
        values = self.fields.get(name)
        return values[-1] if values else None

    def values(self) -> dict[str, Any]:
        """The form as TranscriptionForm reads it: `include[]` parts (or `include` parts) are
        one array, `chunking_strategy[type]` is part of `chunking_strategy`, the last of
        repeated parts wins, and an empty part is a field left out."""
        values: dict[str, Any] = {} if self.file is None else {self.file_part: self.file}
        for name, parts in self.fields.items():
            base, _, key = name.partition("[")
            key = key.removesuffix("]")
            sent = [part for part in parts if part]
            if base in _ARRAYS:
                values.setdefault(base, []).extend(sent)
            elif key and sent and base in TranscriptionForm.model_fields:  # `name[key]` parts
                value = values.get(base)
                values[base] = {**(value if isinstance(value, dict) else {}), key: sent[-1]}
            elif sent:
                values[base if base in TranscriptionForm.model_fields else name] = sent[-1]
        return values


async def read_form(
    request: web.Request,
    max_file_bytes: int = MAX_FILE_BYTES,
    file_parts: tuple[str, ...] = ("file",),
) -> Form:
    """The multipart form, read within the limits (see the module docstring); the file part
    (named one of `file_parts`) within `max_file_bytes` (other forms with a file part, custom
    voices' clips, share it)."""
    if request.content_type != "multipart/form-data":
        raise ApiError(
            400,
            "the request body must be multipart/form-data with a 'file' part "
            f"(got Content-Type {request.content_type!r})",
            code="invalid_request",
        )
    length = request.content_length
    if length is not None and length > max_file_bytes + FORM_OVERHEAD_BYTES:
        raise _too_large(f"the request declares {length} bytes, more", max_file_bytes)
    try:
        reader = await request.multipart()
    except (ValueError, AssertionError) as err:  # a bad boundary
        raise ApiError(400, f"malformed multipart body: {err}", code="invalid_request") from None
    form = Form()
    parts = 0
    while True:
        try:
            part = await reader.next()
        except LineTooLong:
            raise _malformed(f"a part header is longer than {MAX_HEADER_LINE} bytes") from None
        except (ValueError, BadHttpMessage):  # aiohttp's parser: a broken boundary or header
            raise _malformed("a part's boundary or headers are broken") from None
        if part is None:
            return form
        if not isinstance(part, BodyPartReader):
            raise ApiError(400, "nested multipart parts are not accepted", code="invalid_request")
        parts += 1
        if parts > MAX_PARTS:
            raise ApiError(400, f"more than {MAX_PARTS} form parts", code="invalid_request")
        if len(part.headers) > MAX_PART_HEADERS:
            raise _malformed(f"a part has more than {MAX_PART_HEADERS} headers")
        name = part.name or ""
        if part.filename is not None and not _plain_text(part.filename, MAX_FILENAME_CHARS):
            raise invalid_field(
                "file",
                f"the file's name must be at most {MAX_FILENAME_CHARS} characters with no "
                "control characters",
            )
        if name in file_parts:
            if form.file is not None:
                raise invalid_field(name, f"the form has more than one file part ({name})")
            form.file = await _read_part(
                part,
                max_file_bytes,
                on_over=lambda name=name: _too_large("the file is larger", max_file_bytes, name),
            )
            form.filename, form.file_part = part.filename, name
        else:
            data = await _read_part(part, MAX_FIELD_BYTES, on_over=_field_too_large(name))
            try:
                value = data.decode("utf-8")
            except UnicodeDecodeError:
                raise invalid_field(name, f"'{name}' is not UTF-8 text", "invalid_type") from None
            form.fields.setdefault(name, []).append(value)


async def _read_part(part: BodyPartReader, limit: int, on_over) -> bytes:
    data = bytearray()
    try:
        while chunk := await part.read_chunk(READ_CHUNK):
            data += chunk
            if len(data) > limit:
                raise on_over()
    except (ValueError, BadHttpMessage):  # the body ended inside the part: no closing boundary
        raise _malformed("the body ends inside a part (no closing boundary)") from None
    return bytes(data)


def _malformed(what: str) -> ApiError:
    """400 for a form aiohttp's parser refuses; the message never echoes the client's bytes."""
    return ApiError(400, f"malformed multipart body: {what}", code="invalid_request")


def _plain_text(text: str, limit: int) -> bool:
    return len(text) <= limit and not any(ord(c) < 0x20 or ord(c) == 0x7F for c in text)


def _too_large(what: str, limit: int, param: str = "file") -> ApiError:
    return ApiError(
        413,
        f"{what} than the limit; uploads are limited to {limit} bytes ({limit / 2**20:g} MiB)",
        param=param,
        code="request_too_large",
    )


def _field_too_large(name: str):
    def error() -> ApiError:
        return invalid_field(
            name, f"'{name}' is longer than {MAX_FIELD_BYTES} bytes", "string_above_max_length"
        )

    return error


def transcription_model(form: Form, plan: Plan) -> ModelSpec:
    """The served model the form names: checked first, so errors can be counted by it."""
    name = form.one("model")
    if not name:
        raise invalid_field("model", "'model' is required", code="missing_required_parameter")
    return resolve_model(plan, name, task="transcription")


def parse_transcription(form: Form, model: ModelSpec) -> TranscriptionRequest:
    fields = parse(TranscriptionForm, form.values(), form=True)
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
