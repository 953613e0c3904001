"""The settings of a speech input stream (serve/speech_stream.py): from the query string of the
upgrade, then from the first message, which may override them; later messages carry text only.

    model          a model id or alias that serves speech (default: the first one)
    voice          a voice of it: declared, an alias or a custom voice id (required)
    output_format  pcm_<rate>: 8000, 16000, 22050, 24000 (default), 44100 or 48000 Hz
    binary         true: each audio chunk is one binary frame; false (default): JSON, base64
    speed, seed    as the speech endpoint's
ElevenLabs' `model_id` names the model too; its `voice_settings` (only `speed` is read),
`generation_config`, `try_trigger_generation` and `xi_api_key` are accepted. A key nobody
declares is refused by name, as the HTTP endpoints refuse unknown fields.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from omni_server.audio import check_sample_rate
from omni_server.compiler.plan import ModelSpec
from omni_server.contracts import MAX_SEED, MAX_SPEED, MIN_SPEED
from omni_server.serve.errors import ApiError, invalid_field
from omni_server.serve.models import resolve_model
from omni_server.serve.state import ServerState
from omni_server.serve.voice_catalog import VoiceChoice, choose_voice

DEFAULT_RATE = 24_000
SETTINGS = ("model", "model_id", "voice", "output_format", "binary", "speed", "seed")
ACCEPTED = ("voice_settings", "generation_config", "try_trigger_generation", "xi_api_key")
MESSAGE = ("text", "flush", "cancel")


@dataclass(frozen=True)
class Settings:
    model: ModelSpec
    voice: VoiceChoice
    sample_rate: int
    binary: bool
    speed: float
    seed: int | None


def read_settings(
    state: ServerState,
    query: Mapping[str, str],
    message: Mapping[str, Any] | None,
    *,
    only: Iterable[str] | None = None,
) -> Settings | None:
    """The settings of the query (text) laid under the first `message`'s (JSON); None with
    `only`: a later message, whose keys must be among `only` (text, flush, cancel, ...).
    The voice is required once the first message has come (`message` given)."""
    message = message or {}
    if only is not None:
        allowed = set(only) | set(ACCEPTED)
        for key in message:
            if key not in allowed:
                where = "only the first message" if key in SETTINGS else "no message"
                raise invalid_field(
                    key,
                    f"'{key}' is not accepted here: {where} may carry it",
                    code="unknown_parameter",
                )
        _message_fields(message)
        return None
    for key in query:
        if key not in SETTINGS:
            raise invalid_field(
                key,
                f"unknown query parameter '{key}'; valid: {', '.join(SETTINGS)}",
                code="unknown_parameter",
            )
    for key in message:
        if key not in (*SETTINGS, *ACCEPTED, *MESSAGE):
            raise invalid_field(
                key,
                f"unknown field '{key}'; valid: {', '.join((*MESSAGE, *SETTINGS, *ACCEPTED))}",
                code="unknown_parameter",
            )
    _message_fields(message)
    values: dict[str, Any] = {k: _from_text(k, v) for k, v in query.items()}
    values.update({k: v for k, v in message.items() if k in SETTINGS and v is not None})
    if isinstance(message.get("voice_settings"), Mapping) and "speed" in message["voice_settings"]:
        values.setdefault("speed", message["voice_settings"]["speed"])
    model_name = values.get("model", values.get("model_id"))
    model = _model(state, model_name)
    voice = values.get("voice")
    if voice is None and message:
        raise invalid_field(
            "voice",
            "'voice' is required, in the query or the first message",
            code="missing_required_parameter",
        )
    if voice is not None and not isinstance(voice, str):
        raise invalid_field("voice", "'voice' must be a string", code="invalid_type")
    # before the first message a missing voice is no error yet: that message may name it
    choice = choose_voice(voice, model, state.voices, "voice") if voice else VoiceChoice("")
    return Settings(
        model=model,
        voice=choice,
        sample_rate=_rate(values.get("output_format", f"pcm_{DEFAULT_RATE}")),
        binary=_boolean("binary", values.get("binary", False)),
        speed=_speed(values.get("speed", 1.0)),
        seed=_seed(values.get("seed")),
    )


def _model(state: ServerState, name: Any) -> ModelSpec:
    if name is None:
        speaking = [m for m in state.plan.models.values() if "speech" in m.tasks]
        if not speaking:
            raise ApiError(404, "no model of this repository serves speech", code="not_found")
        return speaking[0]
    if not isinstance(name, str):
        raise invalid_field("model", "'model' must be a string", code="invalid_type")
    return resolve_model(state.plan, name, task="speech")


def _message_fields(message: Mapping[str, Any]) -> None:
    text = message.get("text")
    if text is not None and not isinstance(text, str):
        raise invalid_field("text", "'text' must be a string", code="invalid_type")
    for key in ("flush", "cancel", "try_trigger_generation"):
        if key in message and not isinstance(message[key], bool):
            raise invalid_field(key, f"'{key}' must be true or false", code="invalid_type")


def _from_text(key: str, value: str) -> Any:
    """A query parameter's text as its setting's type is checked later: numbers parsed here."""
    if key in ("speed", "seed"):
        try:
            return float(value) if key == "speed" else int(value)
        except ValueError:
            raise invalid_field(key, f"'{key}' must be a number; got {value[:40]!r}") from None
    if key == "binary":
        if value.lower() not in ("true", "false"):
            raise invalid_field(key, "'binary' must be true or false", code="invalid_type")
        return value.lower() == "true"
    return value


def _rate(value: Any) -> int:
    text = value if isinstance(value, str) else ""
    kind, _, rate = text.partition("_")
    try:
        if kind != "pcm" or not rate.isdigit():
            raise ValueError("the format is pcm_<sample rate>, e.g. pcm_24000")
        check_sample_rate("pcm", int(rate))
    except ValueError as err:
        raise invalid_field(
            "output_format", f"'output_format' {str(value)[:40]!r}: {err}", code="unsupported_value"
        ) from None
    return int(rate)


def _boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise invalid_field(key, f"'{key}' must be true or false", code="invalid_type")
    return value


def _speed(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid_field("speed", "'speed' must be a number", code="invalid_type")
    if not MIN_SPEED <= value <= MAX_SPEED:
        raise invalid_field("speed", f"'speed' must lie in {MIN_SPEED:g}..{MAX_SPEED:g}")
    return float(value)


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise invalid_field("seed", f"'seed' must be an integer in 0..{MAX_SEED}")
    return value
