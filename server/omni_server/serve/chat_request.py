"""`POST /v1/chat/completions`: the body parsed as declared (`ChatBody`, serve/chat_body.py),
then what depends on the model; the thinker's inputs are the typed `contracts.ChatInput`.

Every rejection is a 400 naming the field (`param`, with OpenAI's paths such as
`messages[2].content[0].type`) and what would be valid; an unknown model is a 404 listing the
served ones. OpenAI parameters this server cannot honour (tools, logprobs, penalties, images, ...)
are refused with `unsupported_parameter` unless they ask for nothing: an answer that ignored them
would look like one that followed them. OpenAI's bookkeeping fields (`user`, `metadata`, `store`,
...) are accepted and ignored; a field no one declares is refused as OpenAI refuses it
(serve/validation.py).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from omni_server.audio.containers import truncation
from omni_server.audio.encode import OPENAI_SAMPLE_RATE
from omni_server.compiler.plan import ModelSpec, Plan
from omni_server.contracts import (
    AudioPart,
    ChatInput,
    Message,
    Sampling,
    SpeechOptions,
    VoiceReference,
)
from omni_server.serve.chat_body import (
    AUDIO_FORMATS,
    MAX_INPUT_AUDIO_BYTES,
    STREAM_AUDIO_FORMAT,
    AssistantMessage,
    ChatBody,
    InputAudioPart,
    RefusedMessage,
    RefusedPart,
    SystemMessage,
    TextPart,
    UserMessage,
)
from omni_server.serve.errors import ApiError, invalid_field
from omni_server.serve.models import resolve_model
from omni_server.serve.validation import model_name, names, parse
from omni_server.serve.voice_catalog import VoiceCatalog, choose_voice

TASK = "chat"
MAX_BODY_BYTES = 32 << 20  # a chat body may carry base64 audio (4/3 of its bytes)


@dataclass(frozen=True)
class AudioOut:
    """What `modalities: ["text", "audio"]` asked for; `voice` is canonical (alias resolved)."""

    voice: str
    format: str  # OpenAI's name (wav, aac, mp3, flac, opus, pcm16)
    reference: VoiceReference | None = None  # a custom voice's clip (docs/voices.md)

    @property
    def response_format(self) -> str:  # the audio encoder's name (pcm16 -> pcm)
        return AUDIO_FORMATS[self.format]


@dataclass(frozen=True)
class AudioContent:
    """An `input_audio` content part: heard by the transcription model before the thinker reads
    the message (its transcript takes the part's place), or, for a model that hears audio
    itself (`ModelSpec.hears_audio`), handed to its entry as a `contracts.AudioPart`."""

    param: str  # where it sat, e.g. messages[1].content[0]
    data: bytes
    format: str


@dataclass(frozen=True)
class ChatRequest:
    model: ModelSpec
    # {"role": system|user|assistant, "content": str}; a user message with input_audio parts
    # holds a tuple of str and AudioContent (one per client part, in its order) until
    # `transcribed` replaces the audio by its text, or `thinker_input` hands it to a model
    # that hears it
    messages: tuple[dict[str, Any], ...]
    # as the thinker gets it: the request's fields, else the model's defaults (its
    # [sampling]), else OpenAI's (Sampling.resolve)
    sampling: Sampling
    stream: bool
    include_usage: bool  # stream_options.include_usage: a usage chunk before [DONE]
    audio: AudioOut | None  # None: text only

    @property
    def audio_parts(self) -> list[AudioContent]:
        return [
            part
            for message in self.messages
            if isinstance(message["content"], tuple)
            for part in message["content"]
            if isinstance(part, AudioContent)
        ]

    def transcribed(self, transcripts: Mapping[str, str]) -> ChatRequest:
        """The request with each audio part replaced by its transcript (keyed by `param`)."""
        messages = []
        for message in self.messages:
            content = message["content"]
            if isinstance(content, tuple):
                texts = (
                    transcripts[p.param] if isinstance(p, AudioContent) else p for p in content
                )
                content = " ".join(t.strip() for t in texts if t.strip())
            messages.append({**message, "content": content})
        return replace(self, messages=tuple(messages))

    def thinker_input(self) -> ChatInput:
        """The thinker's contract (docs/serving.md): the messages (transcribed, or with their
        clips as `AudioPart`s for a model that hears audio), the sampling, and the voice's
        options when the answer is spoken."""
        assert self.model.hears_audio or not self.audio_parts, "transcribe audio parts first"
        speech = None
        if self.audio is not None:
            # every format at OpenAI's 24 kHz, as its audio models answer (the voice's native
            # rate is 22.05 kHz for the embedded voice): the audio encoder resamples once
            speech = SpeechOptions(
                self.audio.voice,
                response_format=self.audio.response_format,
                stream=self.stream,
                seed=self.sampling.seed,
                sample_rate=OPENAI_SAMPLE_RATE,
                reference=self.audio.reference,
            )
        messages = tuple(Message(m["role"], _heard(m["content"])) for m in self.messages)
        return ChatInput(messages, self.sampling, speech)

    def pipeline_inputs(self) -> dict[str, Any]:
        """The entry stage's inputs: the thinker's contract."""
        return self.thinker_input().payload()


def chat_model(body: Any, plan: Plan) -> ModelSpec:
    """The served model a chat request names: checked first, so errors can be counted by it."""
    return resolve_model(plan, model_name(body), task=TASK)


def parse_chat_request(
    body: dict[str, Any], model: ModelSpec, voices: VoiceCatalog | None = None
) -> ChatRequest:
    """The rest of the request, for the model `chat_model` found; `voices` adds the custom
    voices to the model's declared ones."""
    fields = parse(ChatBody, body)
    if fields.n != 1:
        raise invalid_field(
            "n",
            f"'n' must be 1: this server makes one choice per request; got {fields.n}",
            code="unsupported_value",
        )
    current, legacy = fields.max_completion_tokens, fields.max_tokens
    if current is not None and legacy is not None and current != legacy:
        raise invalid_field(
            "max_tokens",
            f"'max_tokens' ({legacy}) and 'max_completion_tokens' ({current}) disagree; send "
            "'max_completion_tokens' only",
        )
    if fields.stream_options is not None and not fields.stream:
        raise invalid_field(
            "stream_options", "'stream_options' is only allowed when 'stream' is true"
        )
    stop = fields.stop
    sampling = Sampling.resolve(
        model.sampling,
        max_tokens=current if current is not None else legacy,
        temperature=fields.temperature,
        top_p=fields.top_p,
        top_k=fields.top_k,
        min_p=fields.min_p,
        seed=fields.seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
    )
    chat = ChatRequest(
        model=model,
        messages=tuple(_message(i, m) for i, m in enumerate(fields.messages)),
        sampling=sampling,
        stream=fields.stream,
        include_usage=bool(fields.stream_options and fields.stream_options.include_usage),
        audio=_audio_out(fields, model, voices),
    )
    if model.hears_audio:  # the entry decodes the clips: refuse what is plainly no audio now
        for part in chat.audio_parts:
            _check_container(part)
    return chat


def _message(
    index: int, message: SystemMessage | UserMessage | AssistantMessage | RefusedMessage
) -> dict[str, Any]:
    """The pipeline's message: the thinker reads `system` for OpenAI's developer messages."""
    assert not isinstance(message, RefusedMessage), "its role's validator refuses every value"
    where = f"messages[{index}]"
    if message.content is None:  # an assistant message may parse without content
        raise invalid_field(
            f"{where}.content",
            f"'{where}.content' is required for an {message.role} message",
            code="missing_required_parameter",
        )
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": _content(f"{where}.content", message.content)}


def _content(
    param: str, content: str | Sequence[TextPart | InputAudioPart | RefusedPart]
) -> str | tuple[str | AudioContent, ...]:
    """A message's text; a user message with `input_audio` parts keeps its parts in order."""
    if isinstance(content, str):
        return content
    parts: list[str | AudioContent] = []
    for i, part in enumerate(content):
        assert not isinstance(part, RefusedPart), "its type's validator refuses every value"
        at = f"{param}[{i}]"
        parts.append(part.text if isinstance(part, TextPart) else _input_audio(at, part))
    if any(isinstance(p, AudioContent) for p in parts):
        return tuple(parts)
    # OpenAI joins a message's text parts without a separator
    return "".join(str(p) for p in parts)


def _input_audio(at: str, part: InputAudioPart) -> AudioContent:
    data = part.input_audio.data
    if len(data) > MAX_INPUT_AUDIO_BYTES * 4 // 3 + 4:
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
    return AudioContent(param=at, data=audio, format=part.input_audio.format)


def _heard(content: str | tuple[str | AudioContent, ...]) -> str | tuple[str | AudioPart, ...]:
    """A message's content as the entry reads it: text, or its parts in the client's order,
    each clip an `AudioPart` (the bytes as sent; the entry decodes them)."""
    if isinstance(content, str):
        return content
    return tuple(AudioPart(p.data, p.format) if isinstance(p, AudioContent) else p for p in content)


# How each input_audio format's files begin: RIFF/WAVE; an ID3 tag or an MPEG audio frame's
# sync (11 set bits) for mp3.
def _looks_like(data: bytes, fmt: str) -> bool:
    if fmt == "wav":
        return data[:4] in (b"RIFF", b"RF64") and data[8:12] == b"WAVE"
    return data[:3] == b"ID3" or (len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0)


def _check_container(part: AudioContent) -> None:
    """A clip for a model that hears audio itself: its container is the declared format's and
    whole (a wav's data chunk holds what it declares). Decoding is the entry stage's, off the
    server's loop; this cheap look at the header turns plain non-audio into a 400 naming the
    part, as the transcription model's refusal does for a cascade."""
    problem = None
    if not _looks_like(part.data, part.format):
        problem = (
            f"the data is not {part.format} audio (its first bytes are no {part.format} header)"
        )
    elif part.format == "wav":
        problem = truncation(part.data, "wav")
    if problem is not None:
        raise ApiError(400, f"'{part.param}': {problem}", param=part.param, code="invalid_audio")


def _audio_out(fields: ChatBody, model: ModelSpec, voices: VoiceCatalog | None) -> AudioOut | None:
    audio = fields.audio
    if "audio" not in fields.modalities:
        if audio is not None:
            raise invalid_field(
                "audio",
                "'audio' is set but 'modalities' does not ask for audio; send "
                '"modalities": ["text", "audio"] with it, or leave it out',
            )
        return None
    if not model.voices and (voices is None or voices.cloning_stage(model) is None):
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
    if fields.stream and audio.format != STREAM_AUDIO_FORMAT:
        raise invalid_field(
            "audio.format",
            f"streamed audio is raw {STREAM_AUDIO_FORMAT} (as at OpenAI); got {audio.format!r}",
            code="unsupported_value",
        )
    if audio.voice is None:
        if model.default_voice is None:
            catalog = voices or VoiceCatalog.declared_only()
            raise invalid_field(
                "audio.voice",
                f"'audio.voice' is required; valid voices: {names(catalog.names(model))}",
                code="missing_required_parameter",
            )
        return AudioOut(voice=model.default_voice, format=audio.format)
    choice = choose_voice(audio.voice, model, voices, "audio.voice")
    return AudioOut(voice=choice.name, format=audio.format, reference=choice.reference)
