"""Request bodies declared as pydantic models: the shared base, the JSON types, and the one
translation of a `ValidationError` into OpenAI's error JSON.

Each endpoint declares its body once (`speech_request.SpeechBody`, `chat_request.ChatBody`,
`transcription_request.TranscriptionForm`); the same class validates a request and gives the
OpenAPI document its schema. What depends on the served model or the server's options (a voice,
a bound) is checked after this typed parse, in the endpoint's module.

Errors, as OpenAI words them:
- the first error's location is `param`, dotted and indexed (`messages[0].content[1].text`);
  its kind is `code` (`missing_required_parameter`, `invalid_type`, `invalid_value`, ... or the
  code a custom check raised), and the message names the field and what would be valid;
- a top-level field no model declares is refused as OpenAI's chat endpoint refuses one:
  "Unrecognized request argument supplied: NAME", `param` and `code` null; an unknown key of a
  nested object as its schema check words it: "Additional properties are not allowed ('x' was
  unexpected) - 'messages.0'".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    Tag,
    ValidationError,
)
from pydantic_core import ErrorDetails, PydanticCustomError, core_schema

from omni_server.contracts import text_problem
from omni_server.serve.errors import ApiError, invalid_field

Body = TypeVar("Body", bound=BaseModel)


class RequestModel(BaseModel):
    """A request body or one of its objects: JSON's types only (`true` is no number, `"1"` no
    integer), unknown keys refused, immutable once parsed."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def parse(model: type[Body], data: Mapping[str, Any], *, form: bool = False) -> Body:
    """`data` as `model`, or the ApiError of its first problem.

    A JSON null in a declared top-level field is the field left out (clients send null for
    "unset"); a null in an undeclared one is still an unknown field. `form`: the fields of a
    multipart form, which has no nested places, so `param` is always the field."""
    fields = model.model_fields
    present = {k: v for k, v in data.items() if v is not None or k not in fields}
    try:
        return model.model_validate(present)
    except ValidationError as exc:
        raise api_error(exc.errors(include_url=False), form=form) from None


def api_error(errors: list[ErrorDetails], *, form: bool = False) -> ApiError:
    """The ApiError for pydantic's errors: the one place their kinds become OpenAI's codes."""
    unknown = [e for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == 1]
    if unknown:  # OpenAI refuses unknown arguments before it reads any value
        names = ", ".join(str(e["loc"][0]) for e in unknown)
        return ApiError(400, f"Unrecognized request argument supplied: {names}")
    error = errors[0]
    loc = [part for part in error["loc"] if not _is_tag(part)]
    if error["type"] == "extra_forbidden":
        where = ".".join(str(part) for part in loc[:-1])
        return ApiError(
            400, f"Additional properties are not allowed ('{loc[-1]}' was unexpected) - '{where}'"
        )
    param = str(loc[0]) if form else _param(loc)
    code, phrase = _describe(error)
    return invalid_field(param, f"'{param}' {phrase}", code=code)


def _param(loc: list[int | str]) -> str:
    """OpenAI's spelling of a place in the body: `messages[0].content`."""
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else str(part)
    return param


# pydantic's error kinds -> (OpenAI's code, what the message says after the field's name)
_KINDS = {
    "missing": ("missing_required_parameter", "is required"),
    "string_type": ("invalid_type", "must be a string"),
    "bool_type": ("invalid_type", "must be true or false"),
    "int_type": ("invalid_type", "must be an integer"),
    "float_type": ("invalid_type", "must be a number"),
    "float_parsing": ("invalid_type", "must be a number"),
    "list_type": ("invalid_type", "must be an array"),
    "dict_type": ("invalid_type", "must be an object"),
    "model_type": ("invalid_type", "must be an object"),
    "model_attributes_type": ("invalid_type", "must be an object"),
    "bytes_type": ("invalid_type", "must be a file"),
}


def _describe(error: ErrorDetails) -> tuple[str, str]:
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in _KINDS:
        return _KINDS[kind]
    if kind == "literal_error":  # ctx["expected"] is pydantic's "'a', 'b' or 'c'"
        choices = ", ".join(re.findall(r"'([^']*)'", str(ctx.get("expected", ""))))
        return "invalid_value", f"must be one of {choices}; got {error['input']!r}"
    if kind == "too_short" and ctx.get("min_length") == 1:
        return "empty_array", "is empty; send at least one item"
    if kind == "string_too_long" or (kind == "too_long" and isinstance(error["input"], str)):
        return (
            "string_above_max_length",
            f"is {len(error['input'])} characters long; at most {ctx.get('max_length')} are "
            "allowed",
        )
    if kind == "string_too_short":
        return (
            "string_below_min_length",
            f"must be at least {ctx.get('min_length')} characters long",
        )
    if kind == "too_long":
        return (
            "array_above_max_length",
            f"has {ctx.get('actual_length')} items; at most {ctx.get('max_length')} are allowed",
        )
    if kind in _CUSTOM:  # our checks (between, Text, ...) name their code as the kind
        return kind, error["msg"]
    return "invalid_value", f"is invalid: {error['msg']}"


# the codes our own checks raise (PydanticCustomError(code, phrase)); Between raises OpenAI's
# codes of a number out of its bounds
BOUND_CODES = frozenset(
    f"{kind}_{side}_value" for kind in ("integer", "decimal") for side in ("below_min", "above_max")
)
_CUSTOM = frozenset(
    {"invalid_value", "invalid_type", "unsupported_value", "unsupported_parameter"} | BOUND_CODES
)


# -- JSON types --------------------------------------------------------------------------------


def _exact_integer(value: Any) -> Any:
    """JSON has one number type: 1.0 is the integer 1 (and 1.5 stays a float, refused)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Integer = Annotated[int, BeforeValidator(_exact_integer)]


def _valid_unicode(value: str) -> str:
    problem = text_problem(value)
    if problem is not None:
        raise PydanticCustomError("invalid_value", problem)
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]


def check_json_text(value: Any, param: str = "") -> None:
    """400 naming the place (`item.content[0].text`, as `param` is spelled) of the first string
    in a JSON value, key or value, that no codec can carry (`contracts.text_problem`): the one
    check of client text at every edge that parses JSON (HTTP bodies, the speech input
    stream's messages, realtime events), so a lone surrogate never reaches a stage. A loop,
    not recursion: JSON may nest as deep as the parser allowed."""
    pending: list[tuple[str, Any]] = [(param, value)]
    while pending:
        place, item = pending.pop()
        if isinstance(item, str):
            problem = text_problem(item)
            if problem is not None:
                raise _bad_text(place, f"'{place}'" if place else "the body", problem)
        elif isinstance(item, dict):
            for key in item:
                problem = text_problem(key)
                if problem is not None:  # named by where it is: the key itself cannot be sent
                    raise _bad_text(place, f"a key of '{place}'" if place else "a key", problem)
            pending += reversed([(f"{place}.{k}" if place else k, v) for k, v in item.items()])
        elif isinstance(item, list):
            pending += reversed([(f"{place}[{i}]", inner) for i, inner in enumerate(item)])


def _bad_text(place: str, what: str, problem: str) -> ApiError:
    return ApiError(400, f"{what} {problem}", param=place or None, code="invalid_value")


@dataclass(frozen=True)
class Between:
    """`Annotated[float, Between(0, 2)]`: a number in [low, high], one message naming both
    bounds (pydantic's own ge / le name one), and both in the JSON schema. Its codes are
    OpenAI's: `decimal_above_max_value` / `decimal_below_min_value` for a number field,
    `integer_above_max_value` / `integer_below_min_value` for an integer field."""

    low: float
    high: float

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> Any:
        kind = "integer" if _is_integer_type(source) else "decimal"
        return core_schema.no_info_after_validator_function(
            lambda value: self._check(value, kind), handler(source)
        )

    def __get_pydantic_json_schema__(self, schema: Any, handler: GetJsonSchemaHandler) -> Any:
        return {**handler(schema), "minimum": self.low, "maximum": self.high}

    def _check(self, value: float, kind: str) -> float:
        # written so that NaN (a form's "nan") is refused: it compares false to everything
        if self.low <= value <= self.high:
            return value
        side = "below_min" if value < self.low else "above_max"
        raise PydanticCustomError(
            f"{kind}_{side}_value",
            "must be between {low} and {high}; got {got}",
            {"low": _number(self.low), "high": _number(self.high), "got": value},
        )


def _is_integer_type(source: Any) -> bool:
    """`int`, or `Integer` (an Annotated int): the field's declared type, not the value's."""
    return source is int or getattr(source, "__origin__", None) is int


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def extension(description: str, default: Any = None) -> Any:
    """A field this server adds to OpenAI's: marked `x-extension` in the OpenAPI document."""
    return Field(default, description=description, json_schema_extra={"x-extension": True})


def refuse(phrase: str, code: str = "invalid_value") -> Callable[[Any], Any]:
    """A check for AfterValidator that refuses every value it sees, with `phrase`."""

    def check(value: Any) -> Any:
        raise PydanticCustomError(code, phrase, {"got": repr(value)})

    return check


# -- unions told apart by the value's JSON kind -------------------------------------------------
# Trying each branch in turn would report one error per branch at the same place; picking the
# branch by the value's kind reports the one error that matters. pydantic puts the branch's tag
# in an error's location: tags are written <like this>, which no field name can be, and
# `api_error` drops them from `param`.


def tag(name: str) -> Tag:
    return Tag(f"<{name}>")


def _is_tag(part: int | str) -> bool:
    return isinstance(part, str) and part.startswith("<") and part.endswith(">")


def json_kind(value: Any) -> str | None:
    """The tag of a JSON value's kind: <string>, <array>, <object> (None: another kind)."""
    if isinstance(value, str):
        return "<string>"
    if isinstance(value, list):
        return "<array>"
    if isinstance(value, dict):
        return "<object>"
    return None


def by_kind(phrase: str, *kinds: str) -> Discriminator:
    """The discriminator of a union of the JSON `kinds` ("string", "array", "object"), each
    branch tagged `tag(kind)`; a value of another kind is an `invalid_type`: `phrase`."""
    tags = {f"<{kind}>" for kind in kinds}

    def kind_of(value: Any) -> str | None:
        found = json_kind(value)
        return found if found in tags else None

    return Discriminator(kind_of, custom_error_type="invalid_type", custom_error_message=phrase)


def model_name(body: Any) -> str:
    """The `model` a JSON body names, read before the whole body is parsed so that a request's
    errors are counted under its model (the body's model checks it again)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    name = body.get("model")
    if name is None:
        raise invalid_field("model", "'model' is required", code="missing_required_parameter")
    if not isinstance(name, str):
        raise invalid_field("model", "'model' must be a string", code="invalid_type")
    return name


def names(values: Iterable[str]) -> str:
    return ", ".join(values) or "none"
