"""What crosses an edge that stage backends read: typed, frozen, checked once, here.

The server builds these from a request (serve/), the runtime carries them between stages as
they are, and a backend reads them typed from its payload (`SpeechOptions.of(request.inputs)`):
no stage parses a dict of options again, with defaults of its own. A field is declared, given
its default and checked in one place, this module.

    payload key   contract          built by                      read by
    "speech"      SpeechOptions     speech, chat (audio out),     the voice's entry (text frontend,
                                    realtime, the speech stream   Higgs preprocessing), beside
                                                                  "text"; the thinker hands it on
                                                                  with its first chunk
    "chat"        ChatInput         chat, realtime                the thinker
    "options"     AsrOptions        transcription, chat (audio    the recognizer (asr_whisper),
                                    in), realtime                 beside "file"
    "timing"      SpeechTiming      a voice's acoustic stage      its encoder (passed on with
                                    (Piper: its durations) or a   the bytes), then the server's
                                    forced-alignment stage        transports (alignment, words)

Across processes a contract is pickled as its constructor call (`__reduce__`): decoding runs
`__post_init__` again, so what a stage reads from shared memory is checked as the server's
value was (docs/transport.md, "Nothing read from shared memory is trusted").

A leaf module: it imports the plan's `SamplingSpec`, the audio formats and its base (`Contract`
and shared checks), nothing of serve/, pipeline/ or stage/ (tests/test_imports.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from omni_server.audio.encode import FORMATS, check_sample_rate
from omni_server.compiler.plan import NO_SAMPLING, SamplingSpec
from omni_server.contract_base import Contract, _check_text, _integer, _number

MIN_SPEED, MAX_SPEED = 0.25, 4.0
MAX_SEED = 2**63 - 1
MAX_SPEECH_TEMPERATURE = 2.0
ROLES = ("system", "user", "assistant")


def _check_seed(seed: Any) -> None:
    if seed is not None and not (_integer(seed) and 0 <= seed <= MAX_SEED):
        raise ValueError(f"seed must be an integer in 0..{MAX_SEED} or None; got {seed!r}")


def text_problem(text: str) -> str | None:
    """What makes `text` no text a codec can carry, as the end of a sentence naming it, or None.

    JSON may carry a lone UTF-16 surrogate (`"\\ud800"`); Python decodes it into a `str` that
    no UTF-8 encoder, tokenizer or phonemizer accepts. The one check of text from a client:
    the server's edges (serve/validation.py: HTTP bodies, WebSocket messages, realtime
    events) and the stages that encode text (`backend.checked_text`) word it alike."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"has an unpaired UTF-16 surrogate (U+{ord(text[exc.start]):04X}) at character "
            f"{exc.start}; send valid Unicode text"
        )
    return None


# -- speech ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VoiceReference(Contract):
    """A custom voice's clip, for the stage that clones it (docs/voices.md, "The cloning
    seam"): `id` is the request's voice, `path` its stored clip (mono PCM16 WAV)."""

    KEY: ClassVar[str] = "reference"

    id: str
    path: str
    transcript: str
    sample_rate: int
    language: str | None = None

    def __post_init__(self) -> None:
        _check_text("reference.id", self.id)
        _check_text("reference.path", self.path)
        _check_text("reference.language", self.language, optional=True)
        if not isinstance(self.transcript, str) or not self.transcript.strip():
            raise ValueError("reference.transcript must be the clip's non-empty transcript")
        if not (_integer(self.sample_rate) and self.sample_rate > 0):
            raise ValueError(
                f"reference.sample_rate must be a positive integer; got {self.sample_rate!r}"
            )


@dataclass(frozen=True)
class SpeechOptions(Contract):
    """How a voice speaks one request: every endpoint that speaks builds one (speech, chat with
    audio out, realtime, the speech input stream) and the voice's entry stage reads it.

    `voice` is canonical (an alias resolved by the server): a declared voice, or a custom voice's
    id with its `reference`. `stream`: the audio may be encoded progressively (False: one whole
    file). `sample_rate` None: the format's default. `instructions` and `temperature` (the
    speech endpoint's) reach a voice that can act on them; the embedded Piper voice ignores
    both. `timing`: the caller shows word timings (the speech stream, realtime, `timestamps`)."""

    KEY: ClassVar[str] = "speech"

    voice: str
    response_format: str = "mp3"
    stream: bool = True
    speed: float = 1.0
    seed: int | None = None
    sample_rate: int | None = None
    reference: VoiceReference | None = None
    instructions: str | None = None
    temperature: float | None = None
    timing: bool = False  # a voice whose timing costs (forced alignment) makes it only then

    def __post_init__(self) -> None:
        if not isinstance(self.voice, str) or not self.voice:
            raise ValueError(f"voice must be a voice's name; got {self.voice!r}")
        if self.response_format not in FORMATS:
            raise ValueError(
                f"response_format must be one of {', '.join(FORMATS)}; got {self.response_format!r}"
            )
        for flag in ("stream", "timing"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be true or false; got {getattr(self, flag)!r}")
        if not (_number(self.speed) and MIN_SPEED <= self.speed <= MAX_SPEED):
            raise ValueError(f"speed must lie in {MIN_SPEED}..{MAX_SPEED}; got {self.speed!r}")
        _check_seed(self.seed)
        if self.sample_rate is not None:
            if not _integer(self.sample_rate):
                raise ValueError(f"sample_rate must be an integer; got {self.sample_rate!r}")
            check_sample_rate(self.response_format, self.sample_rate)
        if self.reference is not None and not isinstance(self.reference, VoiceReference):
            raise ValueError(f"reference must be a VoiceReference; got {self.reference!r}")
        if self.reference is not None and self.reference.id != self.voice:
            raise ValueError(
                f"a reference names its voice: {self.reference.id!r} != {self.voice!r}"
            )
        _check_text("instructions", self.instructions, optional=True)
        if self.temperature is not None and not (
            _number(self.temperature) and 0 <= self.temperature <= MAX_SPEECH_TEMPERATURE
        ):
            raise ValueError(
                f"temperature must lie in 0..{MAX_SPEECH_TEMPERATURE:g}; got {self.temperature!r}"
            )


# -- speech timing (which word is playing) ----------------------------------------------------


@dataclass(frozen=True)
class WordTiming(Contract):
    """One spoken word: its text, when it plays, and where it lies in its SpeechTiming's
    `characters` ([char_start, char_end), so `timing.text[char_start:char_end] == text`)."""

    KEY: ClassVar[str] = "word"

    text: str
    start_s: float
    end_s: float
    char_start: int
    char_end: int

    def __post_init__(self) -> None:
        _check_text("word.text", self.text)
        if not (_number(self.start_s) and _number(self.end_s) and 0 <= self.start_s <= self.end_s):
            raise ValueError(
                f"word {self.text!r}: 0 <= start_s <= end_s; got {self.start_s!r}, {self.end_s!r}"
            )
        if not (
            _integer(self.char_start) and _integer(self.char_end) and self.char_start >= 0
        ) or self.char_end - self.char_start != len(self.text):
            raise ValueError(
                f"word {self.text!r}: [char_start, char_end) must span its text; "
                f"got [{self.char_start!r}, {self.char_end!r})"
            )


@dataclass(frozen=True)
class SpeechTiming(Contract):
    """When each character and word of spoken text plays; rides under "timing" with the audio
    chunk that speaks it (sent by a voice's acoustic stage, or a forced-alignment stage).

    The character arrays are ElevenLabs' `alignment`: the text the voice spoke (normalized),
    the spaces and punctuation between words included (they share the pause around them).
    `words`: the spoken words in order, spans of `characters`. Times are seconds from the
    first sample of the request's audio, through `speed` (resampling moves none): a chunk's
    timing need not start at 0 (`shifted` moves it). A chunk carries the words whose audio
    starts in it."""

    KEY: ClassVar[str] = "timing"

    characters: tuple[str, ...]
    character_start_times_seconds: tuple[float, ...]
    character_end_times_seconds: tuple[float, ...]
    words: tuple[WordTiming, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.characters)
        if not all(isinstance(c, str) and len(c) == 1 for c in self.characters):
            raise ValueError("characters must be a tuple of single characters")
        starts, ends = self.character_start_times_seconds, self.character_end_times_seconds
        if not (isinstance(starts, tuple) and isinstance(ends, tuple)) or not (
            len(starts) == len(ends) == n
        ):
            raise ValueError(
                f"character start and end times must be tuples of {n} numbers (one per character)"
            )
        for i, (start, end) in enumerate(zip(starts, ends, strict=True)):
            if not (_number(start) and _number(end) and 0 <= start <= end):
                raise ValueError(f"characters[{i}]: 0 <= start <= end; got {start!r}, {end!r}")
        text = self.text
        last = 0
        for i, word in enumerate(self.words):
            if not isinstance(word, WordTiming):
                raise ValueError(f"words[{i}] must be a WordTiming; got {type(word).__name__}")
            if word.char_start < last or text[word.char_start : word.char_end] != word.text:
                raise ValueError(
                    f"words[{i}] {word.text!r} must be the characters [{word.char_start}, "
                    f"{word.char_end}) of the timing's text, after the word before it"
                )
            last = word.char_end

    @property
    def text(self) -> str:
        return "".join(self.characters)

    @property
    def start_s(self) -> float:
        """When its first character starts (0.0 when it has none)."""
        return self.character_start_times_seconds[0] if self.characters else 0.0

    def shifted(self, seconds: float) -> SpeechTiming:
        """The same timing `seconds` later (negative: earlier; never before 0)."""

        def move(t: float) -> float:
            return max(0.0, t + seconds)

        return SpeechTiming(
            characters=self.characters,
            character_start_times_seconds=tuple(map(move, self.character_start_times_seconds)),
            character_end_times_seconds=tuple(map(move, self.character_end_times_seconds)),
            words=tuple(
                dataclasses.replace(w, start_s=move(w.start_s), end_s=move(w.end_s))
                for w in self.words
            ),
        )

    @classmethod
    def joined(cls, timings: Sequence[SpeechTiming]) -> SpeechTiming:
        """One timing for consecutive chunks' timings (a whole response's): the characters in
        order, each word's span re-indexed into them."""
        words: list[WordTiming] = []
        offset = 0
        for timing in timings:
            words.extend(
                dataclasses.replace(
                    w, char_start=w.char_start + offset, char_end=w.char_end + offset
                )
                for w in timing.words
            )
            offset += len(timing.characters)
        return cls(
            characters=tuple(c for t in timings for c in t.characters),
            character_start_times_seconds=tuple(
                s for t in timings for s in t.character_start_times_seconds
            ),
            character_end_times_seconds=tuple(
                e for t in timings for e in t.character_end_times_seconds
            ),
            words=tuple(words),
        )


# -- chat (the thinker) ------------------------------------------------------------------------


MAX_AUDIO_PART_BYTES = 25 * 1024 * 1024  # OpenAI's upload bound for a clip
AUDIO_PART_FORMATS = ("wav", "mp3")  # OpenAI's input_audio formats


@dataclass(frozen=True)
class AudioPart(Contract):
    """A clip a model hears itself (an omni model's own audio encoder, not the transcription
    cascade): the bytes as the client sent them, decoded by the model's first stage, off the
    server's event loop."""

    KEY: ClassVar[str] = "audio"

    data: bytes
    format: str = "wav"

    def __post_init__(self) -> None:
        if not isinstance(self.data, bytes) or not self.data:
            raise ValueError("data must be non-empty bytes")
        if len(self.data) > MAX_AUDIO_PART_BYTES:
            raise ValueError(f"data is over {MAX_AUDIO_PART_BYTES} bytes")
        if self.format not in AUDIO_PART_FORMATS:
            raise ValueError(f"format must be one of {', '.join(AUDIO_PART_FORMATS)}")

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "bytes": len(self.data)}


@dataclass(frozen=True)
class Message(Contract):
    """One conversation turn as the thinker reads it (OpenAI's developer role is `system`).

    `content` is text, or, for a model that hears audio itself, the parts in the order the
    client sent them: text (str) and clips (AudioPart)."""

    KEY: ClassVar[str] = "message"

    role: str
    content: str | tuple[str | AudioPart, ...]

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}; got {self.role!r}")
        if isinstance(self.content, tuple):
            for i, part in enumerate(self.content):
                if not isinstance(part, str | AudioPart):
                    raise ValueError(
                        f"content[{i}] must be text or an AudioPart; got {type(part).__name__}"
                    )
            return
        _check_text("content", self.content)

    @property
    def text(self) -> str:
        """The turn's text alone (its clips left out)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part for part in self.content if isinstance(part, str))


# What a request gets for a field that neither it nor its model's [sampling] sets: OpenAI's
# defaults, top_k and min_p off; max_tokens None is up to the context.
OPENAI_SAMPLING = SamplingSpec(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0)


@dataclass(frozen=True)
class Sampling(Contract):
    """How the thinker samples one answer; `resolve` fills what a request left out. The ranges
    are the API's; the engine's sampler checks what it can run (top_p 0 is refused there)."""

    KEY: ClassVar[str] = "sampling"

    max_tokens: int | None = None  # None: up to the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension (vLLM's and SGLang's name): 0 is off
    min_p: float = 0.0  # extension: 0.0 is off
    seed: int | None = None
    stop: tuple[str, ...] = ()

    @classmethod
    def resolve(
        cls,
        defaults: SamplingSpec = NO_SAMPLING,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        seed: int | None = None,
        stop: tuple[str, ...] = (),
    ) -> Sampling:
        """Each field as the thinker gets it: the request's value (None: left out), else the
        model's default (`defaults`, its entry stage's [sampling]), else OpenAI's."""
        asked = {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
        }
        chosen: dict[str, Any] = {
            name: next(
                (
                    v
                    for v in (value, getattr(defaults, name), getattr(OPENAI_SAMPLING, name))
                    if v is not None
                ),
                None,
            )
            for name, value in asked.items()
        }
        return cls(**chosen, seed=seed, stop=tuple(stop))

    def __post_init__(self) -> None:
        if self.max_tokens is not None and not (_integer(self.max_tokens) and self.max_tokens >= 1):
            raise ValueError(
                f"max_tokens must be a positive integer or None; got {self.max_tokens!r}"
            )
        for name in ("temperature", "top_p", "min_p"):
            if not (_number(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a number >= 0; got {getattr(self, name)!r}")
        if self.top_p > 1 or self.min_p > 1:
            raise ValueError(f"top_p and min_p lie in 0..1; got {self.top_p!r}, {self.min_p!r}")
        if not (_integer(self.top_k) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0; got {self.top_k!r}")
        _check_seed(self.seed)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a tuple of non-empty strings; got {self.stop!r}")


@dataclass(frozen=True)
class ChatInput(Contract):
    """The thinker's inputs (chat and realtime): the conversation, how to sample the answer,
    and the voice's options when the answer is also spoken (None: text only), which the thinker
    hands on with its first chunk."""

    KEY: ClassVar[str] = "chat"

    messages: tuple[Message, ...]
    sampling: Sampling = field(default_factory=Sampling)
    speech: SpeechOptions | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.messages, tuple) or not self.messages:
            raise ValueError("messages must be a non-empty tuple of Message")
        for i, message in enumerate(self.messages):
            if not isinstance(message, Message):
                raise ValueError(f"messages[{i}] must be a Message; got {type(message).__name__}")
        if not isinstance(self.sampling, Sampling):
            raise ValueError(f"sampling must be a Sampling; got {type(self.sampling).__name__}")
        if self.speech is not None and not isinstance(self.speech, SpeechOptions):
            raise ValueError(f"speech must be SpeechOptions or None; got {self.speech!r}")

    def payload(self) -> dict[str, Any]:
        return {self.KEY: self}

    def to_dict(self) -> dict[str, Any]:
        """The thinker's contract as plain values: the messages, the sampling fields, speech."""
        return {
            "messages": [m.to_dict() for m in self.messages],
            **self.sampling.to_dict(),
            "speech": None if self.speech is None else self.speech.to_dict(),
        }


# -- transcription -----------------------------------------------------------------------------


@dataclass(frozen=True)
class AsrOptions(Contract):
    """How the recognizer hears one clip (docs/asr.md); rides beside the clip's `file` bytes."""

    KEY: ClassVar[str] = "options"

    prompt: str | None = None  # Whisper's initial prompt
    temperature: float = 0.0
    words: bool = False  # word timings: an alignment pass, only when asked for
    logprobs: bool = False  # token log-probabilities: a scoring pass, only when asked for

    def __post_init__(self) -> None:
        _check_text("prompt", self.prompt, optional=True)
        if not (_number(self.temperature) and 0 <= self.temperature <= 1):
            raise ValueError(f"temperature must lie in 0..1; got {self.temperature!r}")
        for name in ("words", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false; got {getattr(self, name)!r}")

    def payload(self, file: bytes) -> dict[str, Any]:
        """The ASR entry's inputs: the clip's bytes (any container) and these options."""
        return {"file": file, self.KEY: self}


def speech_payload(text: str, speech: SpeechOptions) -> dict[str, Any]:
    """The speech entry's inputs: the text to say and how (the same two keys the thinker's
    first streamed chunk carries to the voice)."""
    return {"text": text, SpeechOptions.KEY: speech}


# -- a request's seed, for the runtime ---------------------------------------------------------


def seed_of(payload: Mapping[str, Any]) -> int | None:
    """The seed a request's inputs carry: a chat's sampling seed, else a plain payload's
    "seed" (stages that take no contract)."""
    chat = payload.get(ChatInput.KEY)
    if isinstance(chat, ChatInput):
        return chat.sampling.seed
    seed = payload.get("seed")
    return seed if _integer(seed) else None


def with_seed(payload: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """`payload` with `seed` where `seed_of` reads it: a TP leader gives an unseeded request
    one seed for every rank (stage/tp.py)."""
    chat = payload.get(ChatInput.KEY)
    if isinstance(chat, ChatInput):
        sampling = dataclasses.replace(chat.sampling, seed=seed)
        return {**payload, ChatInput.KEY: dataclasses.replace(chat, sampling=sampling)}
    return {**payload, "seed": seed}
