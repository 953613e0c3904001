"""A session's configuration: defaults, `session.update` in GA or beta shape, and its echo.

GA: `{"type": "realtime", "instructions", "output_modalities": ["audio"], "audio": {"input":
{"format", "turn_detection", "transcription"}, "output": {"format", "voice", "speed"}},
"max_output_tokens"}`. Beta: `{"instructions", "modalities": ["text", "audio"], "voice",
"input_audio_format", "output_audio_format", "turn_detection", "input_audio_transcription",
"max_response_output_tokens", "temperature"}`. Both update the same fields; fields a client
leaves out keep their values. Our extension, in either shape: `"seed"` (an integer, or null for
none), as the speech endpoint's; it is not echoed, so the session objects keep OpenAI's shape.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from omni_server.contracts import MAX_SEED, MAX_SPEED, MIN_SPEED
from omni_server.serve.realtime.audio import PCM16, AudioFormat, parse_format
from omni_server.serve.realtime.protocol import ProtocolError

DEFAULT_INSTRUCTIONS = "You are a helpful, concise voice assistant. Answer in one or two sentences."


@dataclass
class TurnDetection:
    """Server VAD (None in the session: turns end only on input_audio_buffer.commit)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True

    def ga(self) -> dict[str, Any]:
        return {"type": "server_vad", **self.__dict__}


@dataclass
class SessionConfig:
    model: str
    voice: str
    instructions: str = DEFAULT_INSTRUCTIONS
    output_modalities: list[str] = field(default_factory=lambda: ["audio"])
    input_format: AudioFormat = PCM16
    output_format: AudioFormat = PCM16
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    transcription: bool = True  # conversation.item.input_audio_transcription.* events
    max_output_tokens: int | None = 256
    temperature: float = 0.8
    speed: float = 1.0
    seed: int | None = None  # our extension: every response's thinker and voice, reproducible

    def update(self, session: Any, voices: tuple[str, ...]) -> None:
        """Apply a session.update's `session` (GA or beta); on any error nothing changes."""
        if not isinstance(session, dict):
            raise ProtocolError("session must be an object", param="session")
        check_no_tools(session, "session")
        new = copy.deepcopy(self)
        audio = session.get("audio") or {}
        if not isinstance(audio, dict):
            raise ProtocolError("session.audio must be an object", param="session.audio")
        audio_in, audio_out = audio.get("input") or {}, audio.get("output") or {}
        if "instructions" in session:
            new.instructions = _string(session["instructions"], "session.instructions")
        for key in ("output_modalities", "modalities"):
            if key in session:
                new.output_modalities = _modalities(session[key], f"session.{key}")
        voice = audio_out.get("voice", session.get("voice"))
        if voice is not None:
            if voice not in voices:
                raise ProtocolError(
                    f"voice {voice!r} is not a voice of {self.model}; voices: {', '.join(voices)}",
                    param="session.voice",
                )
            new.voice = voice
        for value, name, attr in (
            (audio_in.get("format", session.get("input_audio_format")), "input", "input_format"),
            (
                audio_out.get("format", session.get("output_audio_format")),
                "output",
                "output_format",
            ),
        ):
            if value is not None:
                try:
                    setattr(new, attr, parse_format(value))
                except ValueError as err:
                    raise ProtocolError(str(err), param=f"session.audio.{name}.format") from None
        if "turn_detection" in audio_in or "turn_detection" in session:
            raw = audio_in.get("turn_detection", session.get("turn_detection"))
            new.turn_detection = _turn_detection(raw, self.turn_detection)
        if "transcription" in audio_in or "input_audio_transcription" in session:
            raw = audio_in.get("transcription", session.get("input_audio_transcription"))
            new.transcription = raw is not None
        for key in ("max_output_tokens", "max_response_output_tokens"):
            if key in session:
                new.max_output_tokens = _max_tokens(session[key], f"session.{key}")
        if "temperature" in session:
            new.temperature = _number(session["temperature"], "session.temperature", 0.0, 2.0)
        if "seed" in session:
            new.seed = _seed(session["seed"])
        if "speed" in audio_out:
            new.speed = _number(
                audio_out["speed"], "session.audio.output.speed", MIN_SPEED, MAX_SPEED
            )
        self.__dict__.update(new.__dict__)

    def ga(self, session_id: str) -> dict[str, Any]:
        """The session as GA's session.created / session.updated carry it."""
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": session_id,
            "model": self.model,
            "instructions": self.instructions,
            "output_modalities": list(self.output_modalities),
            "audio": {
                "input": {
                    "format": self.input_format.ga(),
                    "turn_detection": self.turn_detection.ga() if self.turn_detection else None,
                    "transcription": {"model": "whisper-1"} if self.transcription else None,
                },
                "output": {
                    "format": self.output_format.ga(),
                    "voice": self.voice,
                    "speed": self.speed,
                },
            },
            "max_output_tokens": self.max_output_tokens or "inf",
        }

    def beta(self, session_id: str) -> dict[str, Any]:
        return {
            "object": "realtime.session",
            "id": session_id,
            "model": self.model,
            "instructions": self.instructions,
            "modalities": ["text", "audio"] if "audio" in self.output_modalities else ["text"],
            "voice": self.voice,
            "input_audio_format": self.input_format.beta_name,
            "output_audio_format": self.output_format.beta_name,
            "turn_detection": self.turn_detection.ga() if self.turn_detection else None,
            "input_audio_transcription": {"model": "whisper-1"} if self.transcription else None,
            "temperature": self.temperature,
            "max_response_output_tokens": self.max_output_tokens or "inf",
        }


# tool_choice values that ask for no call: with no tools, "auto" (OpenAI's default) calls none
NO_TOOL_CHOICES = ("none", "auto")


def check_no_tools(fields: dict[str, Any], where: str) -> None:
    """Refuse tools a session.update or response.create asks for: this server calls none, and an
    answer that ignored them would look like one that chose not to call them. `tools: []` and
    a `tool_choice` of "none" / "auto" ask for nothing and pass."""
    tools = fields.get("tools")
    if tools is not None and tools != []:
        raise ProtocolError(
            f"{where}.tools: this server has no tools to call; send [] or leave it out",
            code="unsupported_parameter",
            param=f"{where}.tools",
        )
    choice = fields.get("tool_choice")
    if choice is not None and choice not in NO_TOOL_CHOICES:
        raise ProtocolError(
            f"{where}.tool_choice {choice!r}: this server has no tools to call; "
            'send "none" or "auto", or leave it out',
            code="unsupported_parameter",
            param=f"{where}.tool_choice",
        )


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str) or len(value) > 16_384:
        raise ProtocolError(f"{param} must be a string of at most 16384 characters", param=param)
    return value


def _modalities(value: Any, param: str) -> list[str]:
    if value in (["audio"], ["text"], ["text", "audio"], ["audio", "text"]):
        return ["audio"] if "audio" in value else ["text"]
    raise ProtocolError(f'{param} must be ["audio"] or ["text"], got {value!r}', param=param)


def _number(value: Any, param: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ProtocolError(f"{param} must be a number in [{low}, {high}]", param=param)
    return float(value)


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise ProtocolError(
            f"session.seed must be an integer in [0, {MAX_SEED}] or null", param="session.seed"
        )
    return value


def _max_tokens(value: Any, param: str) -> int | None:
    if value == "inf" or value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise ProtocolError(f'{param} must be an integer in [1, 4096] or "inf"', param=param)
    return value


def _turn_detection(raw: Any, current: TurnDetection | None) -> TurnDetection | None:
    if raw is None:
        return None
    param = "session.audio.input.turn_detection"
    if not isinstance(raw, dict) or raw.get("type", "server_vad") != "server_vad":
        raise ProtocolError(
            'turn_detection must be null or {"type": "server_vad", ...} (semantic_vad is not '
            "available here)",
            param=param,
        )
    td = copy.copy(current) if current else TurnDetection()
    if "threshold" in raw:
        td.threshold = _number(raw["threshold"], f"{param}.threshold", 0.0, 1.0)
    for name, high in (("prefix_padding_ms", 2000), ("silence_duration_ms", 5000)):
        if name in raw:
            value = raw[name]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
                raise ProtocolError(f"{param}.{name} must be an integer in [0, {high}]")
            setattr(td, name, value)
    for name in ("create_response", "interrupt_response"):
        if name in raw:
            if not isinstance(raw[name], bool):
                raise ProtocolError(f"{param}.{name} must be true or false", param=param)
            setattr(td, name, raw[name])
    return td
