"""Validation of `POST /v1/chat/completions` bodies; the chat pipeline's inputs.

Every rejection is a 400 naming the field (`param`, with OpenAI's paths such as
`messages[2].content[0].type`) and what would be valid; an unknown model is a 404 listing the
served ones. OpenAI parameters this server cannot honour (tools, logprobs, penalties, images, ...)
are refused with `unsupported_parameter` rather than silently ignored: an answer that ignored
them would look like one that followed them. Bookkeeping fields (`user`, `metadata`, `store`,
...) and fields this server does not know are ignored, as OpenAI clients send `extra_body`
fields meant for other servers.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from omni_server.compiler.plan import ModelSpec, Plan
from omni_server.serve.errors import ApiError, invalid_field
from omni_server.serve.json_fields import boolean, integer, number, valid_unicode
from omni_server.serve.models import resolve_model

TASK = "chat"
ROLES = ("system", "developer", "user", "assistant")
# Bounds on the shape of a body (its bytes are bounded by the body limit): a message list this
# long is no conversation, and each item costs validation work before the limit would tell.
MAX_MESSAGES = 2048
MAX_PARTS = 256
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_TOKENS = 2**31 - 1  # the thinker refuses what its context cannot hold (context_length_exceeded)
MAX_SEED = 2**63 - 1  # the speech endpoint's range: the voice takes the same seed
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.0, 2.0
MAX_TOP_K = 1 << 20  # beyond any vocabulary: the same as 0 (off)
# OpenAI's chat `audio.format` -> the audio encoder's response_format
AUDIO_FORMATS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "opus": "opus", "pcm16": "pcm"}
STREAM_AUDIO_FORMAT = "pcm16"  # OpenAI streams chat audio as raw pcm16 only
INPUT_AUDIO_FORMATS = ("wav", "mp3")  # OpenAI's input_audio formats
MAX_INPUT_AUDIO_BYTES = 25 << 20  # per part, as the transcription endpoint's upload limit
MAX_BODY_BYTES = 32 << 20  # a chat body may carry base64 audio (4/3 of its bytes)

# OpenAI parameters whose meaning this server cannot give, and the value that asks for nothing
# (None: any value but null is refused). A request sending the neutral value is served.
_UNSUPPORTED: Mapping[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logprobs": (None, False),
    "top_logprobs": (None,),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
}


@dataclass(frozen=True)
class AudioOut:
    """What `modalities: ["text", "audio"]` asked for; `voice` is canonical (alias resolved)."""

    voice: str
    format: str  # OpenAI's name (wav, mp3, flac, opus, pcm16)

    @property
    def response_format(self) -> str:  # the audio encoder's name (pcm16 -> pcm)
        return AUDIO_FORMATS[self.format]


@dataclass(frozen=True)
class AudioPart:
    """An `input_audio` content part: heard by the transcription model before the thinker reads
    the message (its transcript takes the part's place)."""

    param: str  # where it sat, e.g. messages[1].content[0]
    data: bytes
    format: str


@dataclass(frozen=True)
class ChatRequest:
    model: ModelSpec
    # {"role": system|user|assistant, "content": str}; a user message with input_audio parts
    # holds a tuple of str and AudioPart until `transcribed` replaces the audio by its text
    messages: tuple[dict[str, Any], ...]
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int  # extension (vLLM's and SGLang's name): 0 is off
    min_p: float  # extension: 0.0 is off
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a usage chunk before [DONE]
    audio: AudioOut | None  # None: text only

    @property
    def audio_parts(self) -> list[AudioPart]:
        return [
            part
            for message in self.messages
            if isinstance(message["content"], tuple)
            for part in message["content"]
            if isinstance(part, AudioPart)
        ]

    def transcribed(self, transcripts: Mapping[str, str]) -> ChatRequest:
        """The request with each audio part replaced by its transcript (keyed by `param`)."""
        messages = []
        for message in self.messages:
            content = message["content"]
            if isinstance(content, tuple):
                texts = (transcripts[p.param] if isinstance(p, AudioPart) else p for p in content)
                content = " ".join(t.strip() for t in texts if t.strip())
            messages.append({**message, "content": content})
        return replace(self, messages=tuple(messages))

    def pipeline_inputs(self) -> dict[str, Any]:
        """The entry stage's inputs: the chat contract with the thinker (docs/serving.md)."""
        assert not self.audio_parts, "audio parts are transcribed before the thinker runs"
        speech = None
        if self.audio is not None:
            speech = {
                "voice": self.audio.voice,
                "speed": 1.0,
                "seed": self.seed,
                "response_format": self.audio.response_format,
                "stream": self.stream,
                "sample_rate": None,
            }
        return {
            "messages": [dict(m) for m in self.messages],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": list(self.stop),
            "speech": speech,
        }


def chat_model(body: Any, plan: Plan) -> ModelSpec:
    """The served model a chat request names: checked first, so errors can be counted by it."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    name = body.get("model")
    if name is None:
        raise invalid_field("model", "'model' is required", code="missing_required_parameter")
    if not isinstance(name, str):
        raise invalid_field("model", "'model' must be a string", code="invalid_type")
    return resolve_model(plan, name, task=TASK)


def parse_chat_request(body: dict[str, Any], model: ModelSpec) -> ChatRequest:
    """The rest of the request, for the model `chat_model` found."""
    _refuse_unsupported(body)
    n = integer(body, "n", 1, MAX_TOKENS)
    if n not in (None, 1):
        raise invalid_field(
            "n",
            f"'n' must be 1: this server makes one choice per request; got {n}",
            code="unsupported_value",
        )
    stream = boolean(body, "stream", default=False)
    return ChatRequest(
        model=model,
        messages=_messages(body.get("messages")),
        max_tokens=_max_tokens(body),
        temperature=number(body, "temperature", MIN_TEMPERATURE, MAX_TEMPERATURE, 1.0),
        top_p=number(body, "top_p", 0.0, 1.0, 1.0),
        top_k=integer(body, "top_k", 0, MAX_TOP_K) or 0,
        min_p=number(body, "min_p", 0.0, 1.0, 0.0),
        seed=integer(body, "seed", 0, MAX_SEED),
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=_include_usage(body, stream),
        audio=_audio_out(body, model, stream),
    )


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name, neutral in _UNSUPPORTED.items():
        if name in body and not any(_same(body[name], value) for value in neutral):
            raise invalid_field(
                name,
                f"'{name}' is not supported by this server (its chat models generate plain "
                "text); leave it out",
                code="unsupported_parameter",
            )
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise invalid_field(
            "response_format",
            '\'response_format\' may only be {"type": "text"}: this server has no JSON mode or '
            "structured outputs",
            code="unsupported_parameter",
        )


def _same(value: Any, neutral: Any) -> bool:
    """Equal and of the same JSON type (`false == 0` in Python, not in JSON)."""
    return type(value) is type(neutral) and value == neutral


def _messages(raw: Any) -> tuple[dict[str, Any], ...]:
    if raw is None:
        raise invalid_field("messages", "'messages' is required", code="missing_required_parameter")
    if not isinstance(raw, list):
        raise invalid_field("messages", "'messages' must be an array", code="invalid_type")
    if not raw:
        raise invalid_field(
            "messages",
            "'messages' is empty; send at least one message",
            code="empty_array",
        )
    if len(raw) > MAX_MESSAGES:
        raise invalid_field(
            "messages",
            f"'messages' has {len(raw)} messages; at most {MAX_MESSAGES} are allowed",
            code="array_above_max_length",
        )
    return tuple(_message(i, m) for i, m in enumerate(raw))


def _message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid_field(where, f"'{where}' must be an object", code="invalid_type")
    role = message.get("role")
    if role in ("tool", "function"):
        raise invalid_field(
            f"{where}.role",
            f"'{where}.role' is '{role}': this server has no tools, so no tool messages",
            code="unsupported_value",
        )
    if role not in ROLES:
        raise invalid_field(
            f"{where}.role",
            f"'{where}.role' must be one of {', '.join(ROLES)}; got {role!r}",
        )
    if role == "assistant":
        for name in ("tool_calls", "function_call"):
            if message.get(name):
                raise invalid_field(
                    f"{where}.{name}",
                    f"'{where}.{name}': this server has no tools",
                    code="unsupported_parameter",
                )
        if message.get("audio") is not None:
            raise invalid_field(
                f"{where}.audio",
                f"'{where}.audio': this server keeps no earlier audio answers to refer to; "
                "send the answer's transcript as the message's content",
                code="unsupported_parameter",
            )
    content = _content(where, role, message.get("content"))
    # the pipeline's roles: OpenAI's developer messages are the system prompt of newer models
    return {"role": "system" if role == "developer" else role, "content": content}


def _content(where: str, role: str, content: Any) -> str | tuple[str | AudioPart, ...]:
    """A message's text; a user message with `input_audio` parts keeps its parts in order."""
    param = f"{where}.content"
    if content is None:
        raise invalid_field(
            param, f"'{param}' is required for a {role} message", code="missing_required_parameter"
        )
    if isinstance(content, str):
        return valid_unicode(param, content)
    if not isinstance(content, list):
        raise invalid_field(
            param, f"'{param}' must be a string or an array of content parts", code="invalid_type"
        )
    if len(content) > MAX_PARTS:
        raise invalid_field(
            param,
            f"'{param}' has {len(content)} parts; at most {MAX_PARTS} are allowed",
            code="array_above_max_length",
        )
    parts: list[str | AudioPart] = []
    for i, part in enumerate(content):
        at = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise invalid_field(at, f"'{at}' must be an object", code="invalid_type")
        kind = part.get("type")
        if kind == "input_audio" and role == "user":
            parts.append(_input_audio(at, part.get("input_audio")))
            continue
        if kind != "text":
            raise invalid_field(
                f"{at}.type",
                f"'{at}.type' is {kind!r}: this server's chat models read text parts "
                '({"type": "text", "text": ...}) and, in user messages, input_audio parts',
                code="unsupported_value",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid_field(f"{at}.text", f"'{at}.text' must be a string", code="invalid_type")
        parts.append(valid_unicode(f"{at}.text", text))
    if any(isinstance(p, AudioPart) for p in parts):
        return tuple(parts)
    # OpenAI joins a message's text parts without a separator
    return "".join(str(p) for p in parts)


def _input_audio(at: str, raw: Any) -> AudioPart:
    if not isinstance(raw, dict):
        raise invalid_field(
            f"{at}.input_audio",
            f"'{at}.input_audio' must be an object {{data: base64, format: wav | mp3}}",
            code="invalid_type",
        )
    fmt = raw.get("format")
    if fmt not in INPUT_AUDIO_FORMATS:
        raise invalid_field(
            f"{at}.input_audio.format",
            f"'{at}.input_audio.format' must be one of {', '.join(INPUT_AUDIO_FORMATS)}; "
            f"got {fmt!r}",
        )
    data = raw.get("data")
    if not isinstance(data, str) or len(data) > MAX_INPUT_AUDIO_BYTES * 4 // 3 + 4:
        raise invalid_field(
            f"{at}.input_audio.data",
            f"'{at}.input_audio.data' must be base64 audio of at most "
            f"{MAX_INPUT_AUDIO_BYTES >> 20} MiB",
        )
    try:
        audio = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise invalid_field(
            f"{at}.input_audio.data", f"'{at}.input_audio.data' is not valid base64"
        ) from None
    return AudioPart(param=at, data=audio, format=str(fmt))


def _max_tokens(body: dict[str, Any]) -> int | None:
    """`max_completion_tokens` (OpenAI's current name) or `max_tokens` (the deprecated one)."""
    current = integer(body, "max_completion_tokens", 1, MAX_TOKENS)
    legacy = integer(body, "max_tokens", 1, MAX_TOKENS)
    if current is not None and legacy is not None and current != legacy:
        raise invalid_field(
            "max_tokens",
            f"'max_tokens' ({legacy}) and 'max_completion_tokens' ({current}) disagree; send "
            "'max_completion_tokens' only",
        )
    return current if current is not None else legacy


def _stop(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid_field(
            "stop", "'stop' must be a string or an array of strings", code="invalid_type"
        )
    if len(stops) > MAX_STOP:
        raise invalid_field(
            "stop", f"'stop' has {len(stops)} sequences; at most {MAX_STOP} are allowed"
        )
    for s in stops:
        if not s:
            raise invalid_field("stop", "'stop' sequences must not be empty strings")
        valid_unicode("stop", s)
    return tuple(stops)


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid_field(
            "stream_options",
            "'stream_options' is only allowed when 'stream' is true",
        )
    if not isinstance(options, dict):
        raise invalid_field(
            "stream_options", "'stream_options' must be an object", code="invalid_type"
        )
    usage = options.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise invalid_field(
            "stream_options.include_usage",
            "'stream_options.include_usage' must be true or false",
            code="invalid_type",
        )
    return bool(usage)


def _audio_out(body: dict[str, Any], model: ModelSpec, stream: bool) -> AudioOut | None:
    modalities = body.get("modalities")
    audio = body.get("audio")
    if modalities is None:
        modalities = ["text"]
    if (
        not isinstance(modalities, list)
        or not modalities
        or not set(modalities) <= {"text", "audio"}
        or "text" not in modalities
    ):
        raise invalid_field(
            "modalities",
            f'\'modalities\' must be ["text"] or ["text", "audio"]; got {modalities!r}',
        )
    if "audio" not in modalities:
        if audio is not None:
            raise invalid_field(
                "audio",
                "'audio' is set but 'modalities' does not ask for audio; send "
                '"modalities": ["text", "audio"] with it, or leave it out',
            )
        return None
    if not model.voices:
        raise invalid_field(
            "modalities",
            f"the model '{model.id}' answers in text only (it has no voice); leave \"audio\" "
            "out of 'modalities'",
            code="unsupported_value",
        )
    if audio is None:
        raise invalid_field(
            "audio",
            "'audio' ({\"voice\", \"format\"}) is required when 'modalities' asks for audio",
            code="missing_required_parameter",
        )
    if not isinstance(audio, dict):
        raise invalid_field("audio", "'audio' must be an object", code="invalid_type")
    fmt = audio.get("format")
    if fmt is None:
        raise invalid_field(
            "audio.format",
            f"'audio.format' is required; one of {', '.join(AUDIO_FORMATS)}",
            code="missing_required_parameter",
        )
    if fmt not in AUDIO_FORMATS:
        raise invalid_field(
            "audio.format", f"'audio.format' must be one of {', '.join(AUDIO_FORMATS)}; got {fmt!r}"
        )
    if stream and fmt != STREAM_AUDIO_FORMAT:
        raise invalid_field(
            "audio.format",
            f"streamed audio is raw {STREAM_AUDIO_FORMAT} (as at OpenAI); got {fmt!r}",
            code="unsupported_value",
        )
    return AudioOut(voice=_voice(audio.get("voice"), model), format=fmt)


def _voice(raw: Any, model: ModelSpec) -> str:
    """The canonical voice, as the speech endpoint resolves it (aliases -> a model voice)."""
    names = ", ".join([*model.voices, *model.voice_aliases])
    if raw is None:
        if model.default_voice is not None:
            return model.default_voice
        raise invalid_field(
            "audio.voice",
            f"'audio.voice' is required; valid voices: {names}",
            code="missing_required_parameter",
        )
    if not isinstance(raw, str):
        raise invalid_field("audio.voice", "'audio.voice' must be a string", code="invalid_type")
    if raw in model.voices:
        return raw
    if raw in model.voice_aliases:
        return model.voice_aliases[raw]
    raise invalid_field(
        "audio.voice", f"unknown voice '{raw}' for model '{model.id}'; valid voices: {names}"
    )
