"""The settings of a speech input stream (serve/speech_stream.py): from the query string of the
upgrade, then from the first message, which may override them; later messages carry text only.

    model              a model id or alias that serves speech (default: the first one)
    voice              a voice of it: declared, an alias or a custom voice id (required; on
                       ElevenLabs' path it is the path's `voice_id`)
    output_format      ElevenLabs' names (serve/stream_formats.py): pcm_24000 (our path's
                       default), mp3_44100_128 (ElevenLabs' path's default), ulaw_8000, ...
    binary             true: each audio chunk is one binary frame; false (default): JSON, base64
    speed, seed        as the speech endpoint's
    inactivity_timeout seconds without a client message before the session ends (20; ElevenLabs'
                       query parameter, at most 180)
ElevenLabs' `model_id` names the model too; its `voice_settings` (only `speed` is read),
`generation_config`, `try_trigger_generation`, `xi_api_key`, `authorization` and
`pronunciation_dictionary_locators` are accepted in a message, and its query parameters that
change nothing here (`language_code`, `enable_logging`, ...) in the query. A key nobody declares
is refused by name, as the HTTP endpoints refuse unknown fields.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from omni_server.compiler.plan import ModelSpec
from omni_server.contracts import MAX_SEED, MAX_SPEED, MIN_SPEED
from omni_server.serve.errors import ApiError, invalid_field
from omni_server.serve.models import resolve_model
from omni_server.serve.state import ServerState
from omni_server.serve.stream_formats import OutputFormat, parse_output_format
from omni_server.serve.voice_catalog import VoiceChoice, choose_voice

DEFAULT_FORMAT = "pcm_24000"
ELEVENLABS_DEFAULT_FORMAT = "mp3_44100_128"  # what ElevenLabs' SDK asks for unless told
DEFAULT_INACTIVITY_S = 20.0  # ElevenLabs' default
MAX_INACTIVITY_S = 180.0  # ElevenLabs' maximum
SETTINGS = (
    "model",
    "model_id",
    "voice",
    "output_format",
    "binary",
    "speed",
    "seed",
    "inactivity_timeout",
)
ACCEPTED = (
    "voice_settings",
    "generation_config",
    "try_trigger_generation",
    "xi_api_key",
    "authorization",
    "pronunciation_dictionary_locators",
)
# ElevenLabs' query parameters that change nothing here (logging, SSML, latency modes, timing
# data, language hints): accepted so their clients' URLs connect, and ignored.
ACCEPTED_QUERY = (
    "language_code",
    "enable_logging",
    "enable_ssml_parsing",
    "optimize_streaming_latency",
    "sync_alignment",
    "auto_mode",
    "apply_text_normalization",
)
MESSAGE = ("text", "flush", "cancel")


@dataclass(frozen=True)
class Settings:
    model: ModelSpec
    voice: VoiceChoice
    output: OutputFormat
    binary: bool
    speed: float
    seed: int | None
    inactivity_timeout_s: float = DEFAULT_INACTIVITY_S


def read_settings(
    state: ServerState,
    query: Mapping[str, str],
    message: Mapping[str, Any] | None,
    *,
    only: Iterable[str] | None = None,
    default_format: str = DEFAULT_FORMAT,
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
        if key not in (*SETTINGS, *ACCEPTED_QUERY):
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
    values: dict[str, Any] = {k: _from_text(k, v) for k, v in query.items() if k in SETTINGS}
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
        output=_output(values.get("output_format", default_format)),
        binary=_boolean("binary", values.get("binary", False)),
        speed=_speed(values.get("speed", 1.0)),
        seed=_seed(values.get("seed")),
        inactivity_timeout_s=_inactivity(values.get("inactivity_timeout", DEFAULT_INACTIVITY_S)),
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
    if key in ("speed", "seed", "inactivity_timeout"):
        try:
            return int(value) if key == "seed" else float(value)
        except ValueError:
            raise invalid_field(key, f"'{key}' must be a number; got {value[:40]!r}") from None
    if key == "binary":
        if value.lower() not in ("true", "false"):
            raise invalid_field(key, "'binary' must be true or false", code="invalid_type")
        return value.lower() == "true"
    return value


def _output(value: Any) -> OutputFormat:
    try:
        return parse_output_format(value)
    except ValueError as err:
        raise invalid_field(
            "output_format", f"'output_format' {str(value)[:40]!r}: {err}", code="unsupported_value"
        ) from None


def _inactivity(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid_field("inactivity_timeout", "'inactivity_timeout' must be a number")
    if not 0 < value <= MAX_INACTIVITY_S:
        raise invalid_field(
            "inactivity_timeout",
            f"'inactivity_timeout' must lie in (0, {MAX_INACTIVITY_S:g}] seconds",
        )
    return float(value)


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
