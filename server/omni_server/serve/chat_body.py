"""The body of `POST /v1/chat/completions`, declared: `ChatBody` validates a request and gives
the OpenAPI document its schema. What depends on the served model (a voice, audio out) is
checked after this parse, in serve/chat_request.py.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    ConfigDict,
    Discriminator,
    Field,
    ValidationError,
    WrapValidator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError, core_schema

from omni_server.contracts import MAX_SEED
from omni_server.serve.validation import (
    Between,
    Integer,
    RequestModel,
    Text,
    by_kind,
    extension,
    names,
    refuse,
    tag,
)
from omni_server.serve.voice_catalog import Voice

ROLES = ("system", "developer", "user", "assistant")
# Bounds on the shape of a body (its bytes are bounded by the body limit): a message list this
# long is no conversation, and each item costs validation work before the limit would tell.
MAX_MESSAGES = 2048
MAX_PARTS = 256
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_TOKENS = 2**31 - 1  # the thinker refuses what its context cannot hold (context_length_exceeded)
MAX_TOP_K = 1 << 20  # beyond any vocabulary: the same as 0 (off)
# OpenAI's chat `audio.format` -> the audio encoder's response_format
AudioFormat = Literal["wav", "aac", "mp3", "flac", "opus", "pcm16"]
AUDIO_FORMATS = {
    "wav": "wav",
    "aac": "aac",
    "mp3": "mp3",
    "flac": "flac",
    "opus": "opus",
    "pcm16": "pcm",
}
assert tuple(AUDIO_FORMATS) == get_args(AudioFormat)
STREAM_AUDIO_FORMAT = "pcm16"  # OpenAI streams chat audio as raw pcm16 only
InputAudioFormat = Literal["wav", "mp3"]  # OpenAI's input_audio formats
MAX_INPUT_AUDIO_BYTES = 25 << 20  # per part, as the transcription endpoint's upload limit


# -- messages ------------------------------------------------------------------------------------
# A message is told apart by its role and a content part by its type, so that an error names the
# one place that is wrong. A role or part type this server does not read goes to a branch that
# refuses it (hidden from the schema): its `param` is then the role or the type.


class TextPart(RequestModel):
    type: Literal["text"]
    text: Text


class InputAudio(RequestModel):
    data: str = Field(description="base64 of the audio file (at most 25 MiB)")
    format: InputAudioFormat


class InputAudioPart(RequestModel):
    """Heard by the transcription model; its transcript takes the part's place."""

    type: Literal["input_audio"]
    input_audio: InputAudio


class RefusedPart(RequestModel):
    model_config = ConfigDict(extra="ignore")  # its type is refused; the rest is never read
    type: Annotated[
        Any,
        AfterValidator(
            refuse(
                "is {got}: this server's chat models read text parts "
                '({"type": "text", "text": ...}) and, in user messages, input_audio parts',
                code="unsupported_value",
            )
        ),
    ]


def _part_kind(value: Any, types: tuple[str, ...]) -> str | None:
    if not isinstance(value, dict):
        return None
    kind = value.get("type")
    return f"<{kind}>" if kind in types else "<refused>"


_PART_ERROR = {"custom_error_type": "invalid_type", "custom_error_message": "must be an object"}
_Refused = Annotated[SkipJsonSchema[RefusedPart], tag("refused")]
UserPart = Annotated[
    Annotated[TextPart, tag("text")] | Annotated[InputAudioPart, tag("input_audio")] | _Refused,
    Discriminator(lambda v: _part_kind(v, ("text", "input_audio")), **_PART_ERROR),
]
TextOnlyPart = Annotated[
    Annotated[TextPart, tag("text")] | _Refused,
    Discriminator(lambda v: _part_kind(v, ("text",)), **_PART_ERROR),
]
_CONTENT = by_kind("must be a string or an array of content parts", "string", "array")
UserContent = Annotated[
    Annotated[Text, tag("string")]
    | Annotated[list[UserPart], Field(max_length=MAX_PARTS), tag("array")],
    _CONTENT,
]
TextContent = Annotated[
    Annotated[Text, tag("string")]
    | Annotated[list[TextOnlyPart], Field(max_length=MAX_PARTS), tag("array")],
    _CONTENT,
]


def _no_tools(value: Any) -> Any:
    if value:  # an empty list asks for nothing
        raise PydanticCustomError("unsupported_parameter", "this server has no tools")
    return value


class SystemMessage(RequestModel):
    """`developer` is OpenAI's newer name for the system prompt; the thinker reads `system`."""

    role: Literal["system", "developer"]
    content: TextContent
    name: str | None = None


class UserMessage(RequestModel):
    role: Literal["user"]
    content: UserContent
    name: str | None = None


class AssistantMessage(RequestModel):
    role: Literal["assistant"]
    content: TextContent | None = None  # null only beside tool calls, which are refused
    name: str | None = None
    refusal: str | None = None
    tool_calls: Annotated[Any, AfterValidator(_no_tools)] = None
    function_call: Annotated[Any, AfterValidator(_no_tools)] = None
    audio: Annotated[
        Any,
        AfterValidator(
            refuse(
                "this server keeps no earlier audio answers to refer to; send the answer's "
                "transcript as the message's content",
                code="unsupported_parameter",
            )
        ),
    ] = None


def _refuse_role(role: Any) -> Any:
    if role in ("tool", "function"):
        raise PydanticCustomError(
            "unsupported_value",
            "is {got}: this server has no tools, so no tool messages",
            {"got": repr(role)},
        )
    raise PydanticCustomError(
        "invalid_value",
        "must be one of {roles}; got {got}",
        {"roles": names(ROLES), "got": repr(role)},
    )


class RefusedMessage(RequestModel):
    model_config = ConfigDict(extra="ignore")  # its role is refused; the rest is never read
    role: Annotated[Any, AfterValidator(_refuse_role)]


def _message_kind(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    role = value.get("role")
    return "<system>" if role == "developer" else f"<{role}>" if role in ROLES else "<refused>"


Message = Annotated[
    Annotated[SystemMessage, tag("system")]
    | Annotated[UserMessage, tag("user")]
    | Annotated[AssistantMessage, tag("assistant")]
    | Annotated[SkipJsonSchema[RefusedMessage], tag("refused")],
    Discriminator(_message_kind, **_PART_ERROR),
]


# -- the body ------------------------------------------------------------------------------------


class Neutral:
    """An OpenAI parameter this server cannot honour, served only at a value that asks for
    nothing (`tools: []`); of the same JSON type (`false == 0` in Python, not in JSON)."""

    def __init__(self, *values: Any, hint: str = "leave it out") -> None:
        self.values, self.hint = values, hint

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> Any:
        shown = " or ".join(json.dumps(v) for v in self.values) or "null"
        return {**handler(schema), "description": f"not supported: accepted only as {shown}"}

    def _check(self, value: Any) -> Any:
        if not any(type(value) is type(v) and value == v for v in self.values):
            raise PydanticCustomError(
                "unsupported_parameter",
                "is not supported by this server (its chat models generate plain text); {hint}",
                {"hint": self.hint},
            )
        return value


def _stops(stop: str | list[str]) -> str | list[str]:
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP:
        raise PydanticCustomError(
            "invalid_value",
            "has {n} sequences; at most {max} are allowed",
            {"n": len(stops), "max": MAX_STOP},
        )
    if not all(stops):
        raise PydanticCustomError("invalid_value", "sequences must not be empty strings")
    return stop


Stop = Annotated[
    Annotated[Text, tag("string")] | Annotated[list[Text], tag("array")],
    by_kind("must be a string or an array of strings", "string", "array"),
    AfterValidator(_stops),
]


def _modalities(value: Any, handler: Any) -> list[str]:
    """One message for every wrong form (an array of other names, a string, ...)."""
    try:
        modalities = handler(value)
    except ValidationError:
        modalities = []
    if "text" not in modalities:
        raise PydanticCustomError(
            "invalid_value",
            'must be ["text"] or ["text", "audio"]; got {got}',
            {"got": repr(value)},
        )
    return modalities


class StreamOptions(RequestModel):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted; chunks here are never padded


class AudioParams(RequestModel):
    voice: Voice | None = Field(None, description="the model's default_voice when left out")
    format: AudioFormat


_Bounded = Annotated[Integer, Between(1, MAX_TOKENS)]
_DEFAULT = "left out: the model's default (sampling in /v1/models), else OpenAI's"


class ChatBody(RequestModel):
    """The JSON body of `POST /v1/chat/completions`."""

    model: str = Field(description="a model id or alias that serves chat")
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: _Bounded | None = Field(
        None, description="left out: the model's default max_tokens (/v1/models), else the context"
    )
    max_tokens: _Bounded | None = Field(None, description="deprecated: max_completion_tokens")
    # Left out (or null), a sampling field takes the model's default (its entry stage's
    # [sampling], shown in /v1/models), else OpenAI's: serve/chat_request.py fills it.
    temperature: Annotated[float, Between(0.0, 2.0)] | None = Field(None, description=_DEFAULT)
    top_p: Annotated[float, Between(0.0, 1.0)] | None = Field(None, description=_DEFAULT)
    top_k: Annotated[Integer, Between(0, MAX_TOP_K)] | None = extension("0 is off; " + _DEFAULT)
    min_p: Annotated[float, Between(0.0, 1.0)] | None = extension("0 is off; " + _DEFAULT)
    seed: Annotated[Integer, Between(0, MAX_SEED)] | None = None
    stop: Stop | None = None
    n: _Bounded = Field(1, description="only 1")
    stream: bool = False
    stream_options: StreamOptions | None = None
    modalities: Annotated[list[Literal["text", "audio"]], WrapValidator(_modalities)] = ["text"]
    audio: AudioParams | None = None
    response_format: Annotated[Any, Neutral({"type": "text"}, hint='send {"type": "text"}')] = None
    # OpenAI's parameters this server cannot honour
    tools: Annotated[Any, Neutral([])] = None
    tool_choice: Annotated[Any, Neutral("none")] = None
    functions: Annotated[Any, Neutral([])] = None
    function_call: Annotated[Any, Neutral("none")] = None
    logprobs: Annotated[Any, Neutral(False)] = None
    top_logprobs: Annotated[Any, Neutral()] = None
    logit_bias: Annotated[Any, Neutral({})] = None
    presence_penalty: Annotated[Any, Neutral(0, 0.0)] = None
    frequency_penalty: Annotated[Any, Neutral(0, 0.0)] = None
    prediction: Annotated[Any, Neutral()] = None
    web_search_options: Annotated[Any, Neutral()] = None
    reasoning_effort: Annotated[Any, Neutral()] = None
    verbosity: Annotated[Any, Neutral()] = None
    moderation: Annotated[Any, Neutral()] = None
    # OpenAI's bookkeeping: accepted, not used (no answer is stored, cached or billed here)
    user: Any = None
    parallel_tool_calls: Any = None  # no tools, so no parallel calls of them
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
