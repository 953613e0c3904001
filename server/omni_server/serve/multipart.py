"""A multipart form read within bounds, part by part as it arrives: what the endpoints that
take an upload share (transcriptions, custom voices' clips).

The body is never read whole: a Content-Length over the limit is refused before a byte is read,
and the file part's bytes are counted while they stream in, so an upload without a length
(chunked) is cut off at the limit too. Every other part is a small text field with its own
bound. Every rejection is a 400 naming the field (`param`); 413 for an upload over the limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, get_origin

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from pydantic import BaseModel

from omni_server.serve.errors import ApiError, invalid_field

MAX_FILE_BYTES = 25 * 1024 * 1024  # OpenAI's upload limit: 25 MB
MAX_FIELD_BYTES = 64 * 1024  # a text field (the prompt is the longest: Whisper reads 224 tokens)
MAX_PARTS = 64
MAX_PART_HEADERS = 16  # a form part has two or three (Content-Disposition, Content-Type)
MAX_HEADER_LINE = 8190  # aiohttp's line limit for a part header
MAX_FILENAME_CHARS = 1024
FORM_OVERHEAD_BYTES = 1024 * 1024  # boundaries, part headers and the text fields around the file
READ_CHUNK = 64 * 1024


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

    def values(self, model: type[BaseModel]) -> dict[str, Any]:
        """The form as `model` reads it: `include[]` parts (or `include` parts) of an array
        field are one array, `chunking_strategy[type]` is part of `chunking_strategy`, the last
        of repeated parts wins, and an empty part is a field left out."""
        arrays = {n for n, f in model.model_fields.items() if get_origin(f.annotation) is list}
        values: dict[str, Any] = {} if self.file is None else {self.file_part: self.file}
        for name, parts in self.fields.items():
            base, _, key = name.partition("[")
            key = key.removesuffix("]")
            sent = [part for part in parts if part]
            if base in arrays:
                values.setdefault(base, []).extend(sent)
            elif key and sent and base in model.model_fields:  # `name[key]` parts: one object
                value = values.get(base)
                values[base] = {**(value if isinstance(value, dict) else {}), key: sent[-1]}
            elif sent:
                values[base if base in model.model_fields else name] = sent[-1]
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
