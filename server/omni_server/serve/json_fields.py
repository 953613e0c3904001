"""Typed reads of one field of a JSON request body, each refusal a 400 naming the field.

JSON's types, not Python's: `true` is no number and `1.0` is an integer. Every endpoint that
takes a JSON body (speech, chat) reads its fields through these.
"""

from __future__ import annotations

from typing import Any

from omni_server.serve.errors import invalid_field


def required_str(body: dict[str, Any], name: str) -> str:
    if name not in body or body[name] is None:
        raise invalid_field(name, f"'{name}' is required", code="missing_required_parameter")
    value = body[name]
    if not isinstance(value, str):
        raise invalid_field(name, f"'{name}' must be a string", code="invalid_type")
    return value


def optional_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise invalid_field(name, f"'{name}' must be a string", code="invalid_type")
    return value


def choice(body: dict[str, Any], name: str, choices: tuple[str, ...], default: str | None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if value not in choices:
        raise invalid_field(name, f"'{name}' must be one of {', '.join(choices)}; got {value!r}")
    return value


def boolean(body: dict[str, Any], name: str, *, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid_field(name, f"'{name}' must be true or false", code="invalid_type")
    return value


def number(body: dict[str, Any], name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    # bool is an int in Python, never a number in JSON
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid_field(name, f"'{name}' must be a number", code="invalid_type")
    if not low <= value <= high:
        raise invalid_field(name, f"'{name}' must be between {low:g} and {high:g}; got {value}")
    return float(value)


def integer(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_field(name, f"'{name}' must be an integer", code="invalid_type")
    if not low <= value <= high:
        raise invalid_field(name, f"'{name}' must be between {low} and {high}; got {value}")
    return value


def valid_unicode(param: str, value: str) -> str:
    """JSON may carry a lone UTF-16 surrogate (\\ud800); no text codec or tokenizer can."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise invalid_field(
            param,
            f"'{param}' has an unpaired UTF-16 surrogate (U+{ord(value[exc.start]):04X}) at "
            f"character {exc.start}; send valid Unicode text",
        ) from None
    return value
