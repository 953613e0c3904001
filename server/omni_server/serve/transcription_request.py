"""Reading and validating `POST /v1/audio/transcriptions`: OpenAI's multipart form, bounded.

The body is read part by part as it arrives, never whole: a Content-Length over the limit is
refused before a byte is read, and the file part's bytes are counted while they stream in, so an
upload without a length (chunked) is cut off at the limit too. Every other part is a small text
field with its own bound. Fields this server does not know are read (bounded) and ignored, as
OpenAI clients send fields meant for other servers.

Every rejection is a 400 naming the field (`param`); 413 for an upload over the limit; an unknown
model is a 404 listing the served ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import BodyPartReader, web

from omni_server.compiler.plan import ModelSpec, Plan
from omni_server.serve.errors import ApiError, invalid_field
from omni_server.serve.models import resolve_model

MAX_FILE_BYTES = 25 * 1024 * 1024  # OpenAI's upload limit: 25 MB
MAX_FIELD_BYTES = 64 * 1024  # a text field (the prompt is the longest: Whisper reads 224 tokens)
MAX_PARTS = 64
FORM_OVERHEAD_BYTES = 1024 * 1024  # boundaries, part headers and the text fields around the file
READ_CHUNK = 64 * 1024

RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
GRANULARITIES = ("segment", "word")
INCLUDE = ("logprobs",)  # accepted; Whisper here reports no per-token log probabilities
LANGUAGES = ("en", "english")  # tiny.en hears English only
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.0, 1.0


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

    def pipeline_inputs(self) -> dict[str, Any]:
        return asr_inputs(
            self.file, prompt=self.prompt, temperature=self.temperature, words=self.words
        )


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

    def one(self, name: str) -> str | None:
        values = self.fields.get(name)
        return values[-1] if values else None

    def many(self, name: str) -> list[str]:
        return self.fields.get(name + "[]", []) + self.fields.get(name, [])


async def read_form(request: web.Request) -> Form:
    """The multipart form, read within the limits (see the module docstring)."""
    if request.content_type != "multipart/form-data":
        raise ApiError(
            400,
            "the request body must be multipart/form-data with a 'file' part "
            f"(got Content-Type {request.content_type!r})",
            code="invalid_request",
        )
    length = request.content_length
    if length is not None and length > MAX_FILE_BYTES + FORM_OVERHEAD_BYTES:
        raise _too_large(f"the request declares {length} bytes")
    try:
        reader = await request.multipart()
    except (ValueError, AssertionError) as err:  # a bad boundary
        raise ApiError(400, f"malformed multipart body: {err}", code="invalid_request") from None
    form = Form()
    parts = 0
    while True:
        try:
            part = await reader.next()
        except ValueError as err:  # aiohttp's parser: a broken boundary or part header
            raise ApiError(
                400, f"malformed multipart body: {err}", code="invalid_request"
            ) from None
        if part is None:
            return form
        if not isinstance(part, BodyPartReader):
            raise ApiError(400, "nested multipart parts are not accepted", code="invalid_request")
        parts += 1
        if parts > MAX_PARTS:
            raise ApiError(400, f"more than {MAX_PARTS} form parts", code="invalid_request")
        name = part.name or ""
        if name == "file":
            if form.file is not None:
                raise invalid_field("file", "the form has more than one 'file' part")
            form.file = await _read_part(part, MAX_FILE_BYTES, on_over=_file_too_large)
            form.filename = part.filename
        else:
            data = await _read_part(part, MAX_FIELD_BYTES, on_over=_field_too_large(name))
            try:
                value = data.decode("utf-8")
            except UnicodeDecodeError:
                raise invalid_field(name, f"'{name}' is not UTF-8 text", "invalid_type") from None
            form.fields.setdefault(name, []).append(value)


async def _read_part(part: BodyPartReader, limit: int, on_over) -> bytes:
    data = bytearray()
    while chunk := await part.read_chunk(READ_CHUNK):
        data += chunk
        if len(data) > limit:
            raise on_over()
    return bytes(data)


def _too_large(what: str) -> ApiError:
    return ApiError(
        413,
        f"{what}; uploads are limited to {MAX_FILE_BYTES} bytes (25 MB)",
        param="file",
        code="request_too_large",
    )


def _file_too_large() -> ApiError:
    return _too_large("the file is larger than the limit")


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
    if form.file is None:
        raise invalid_field(
            "file", "'file' is required: the audio to transcribe", "missing_required_parameter"
        )
    _language(form, model)
    response_format = form.one("response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise invalid_field(
            "response_format",
            f"'response_format' must be one of {', '.join(RESPONSE_FORMATS)}; "
            f"got {response_format!r}",
        )
    granularities = tuple(dict.fromkeys(form.many("timestamp_granularities")))
    for g in granularities:
        if g not in GRANULARITIES:
            raise invalid_field(
                "timestamp_granularities",
                f"'timestamp_granularities[]' values must be segment or word; got {g!r}",
            )
    if granularities and response_format != "verbose_json":
        raise invalid_field(
            "timestamp_granularities",
            "'timestamp_granularities[]' needs response_format verbose_json",
        )
    include = tuple(form.many("include"))
    for item in include:
        if item not in INCLUDE:
            raise invalid_field(
                "include", f"'include[]' accepts {', '.join(INCLUDE)}; got {item!r}"
            )
    return TranscriptionRequest(
        model=model,
        file=form.file,
        filename=form.filename,
        prompt=form.one("prompt") or None,
        temperature=_temperature(form),
        response_format=response_format,
        # verbose_json lists segments unless only words were asked for
        granularities=granularities or (("segment",) if response_format == "verbose_json" else ()),
        stream=_boolean(form, "stream"),
        include=include,
    )


def _language(form: Form, model: ModelSpec) -> None:
    language = form.one("language")
    if language and language.strip().lower() not in LANGUAGES:
        raise invalid_field(
            "language",
            f"the model '{model.id}' transcribes English only; 'language' must be 'en' "
            f"(or left out), got {language!r}",
            code="unsupported_language",
        )


def _temperature(form: Form) -> float:
    raw = form.one("temperature")
    if raw is None or raw == "":
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise invalid_field(
            "temperature", "'temperature' must be a number", "invalid_type"
        ) from None
    if not MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:
        raise invalid_field(
            "temperature",
            f"'temperature' must be between {MIN_TEMPERATURE} and {MAX_TEMPERATURE}; got {raw}",
        )
    return value


def _boolean(form: Form, name: str) -> bool:
    raw = form.one(name)
    if raw is None or raw == "":
        return False
    value = raw.strip().lower()
    if value not in ("true", "false"):
        raise invalid_field(name, f"'{name}' must be true or false; got {raw!r}", "invalid_type")
    return value == "true"
