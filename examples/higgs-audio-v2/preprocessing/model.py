"""Preprocessing: an OpenAI speech request -> the conversation the reference processor renders.

Inputs: `text` and `speech`, the typed `contracts.SpeechOptions` (docs/backends.md: voice,
speed, seed, response_format, stream, sample_rate, reference, instructions, temperature). The
conversation is the one
bosonai documents for TTS: the system message (the request's `instructions`, else the stage's
`system`) with the scene description inside the system turn, then the text. A voice with a clip
is cloned as the reference does it: its transcript as a user turn and its clip as the
assistant's audio answer come before the text.

Voices: the declared voices of the models whose requests come here (`context.models`: the
compiled plan's, so `--models.<id>.voices` overrides count) and the custom voices users add
(POST /v1/audio/voices: this stage declares `voice_cloning`). A declared voice other than a
model's `default_voice` is a clip in voices/ (`<name>.wav`, 24 kHz mono or any rate and
channels the decoder reads) with its transcript (`<name>.txt`); the default voice has no clip
(the model's own speaker). A custom voice arrives with its request as the speech contract's
`reference` (a `VoiceReference`, docs/voices.md: its stored clip's path and its transcript).
`VoiceLibrary.lookup` is the one place a voice becomes (clip path, transcript). Out:
{"conversation", "prompt_text", "voice": {"name", "clip", "transcript", "custom"}, "sampling",
"encoding"} to the audio encoder.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_server.audio.higgs_codec import HiggsCheckpointError, open_checkpoint
from omni_server.backend import InvalidRequest, StageBackend, StageConfigError, StageContext
from omni_server.compiler import ModelSpec
from omni_server.contracts import SpeechOptions, VoiceReference
from omni_server.engine import ChatTemplateError, HFTokenizer


@dataclass(frozen=True)
class Voice:
    name: str  # the speech contract's `voice`: a declared voice, or a custom voice's id
    clip: Path | None  # None: the model's own speaker, no reference audio in the prompt
    transcript: str | None
    # made with POST /v1/audio/voices: its clip never changes under its id (the audio encoder
    # caches its codes by id), and may vanish when the voice is deleted mid-request
    custom: bool = False


class VoiceLibrary:
    """Voice name -> its reference clip and transcript: the declared voices of `models` from
    `folder`, checked once at start; a custom voice from its request's `reference`."""

    def __init__(self, folder: Path, models: Iterable[ModelSpec]) -> None:
        models = list(models)
        own = {m.default_voice for m in models if m.default_voice is not None}
        self.voices: dict[str, Voice] = {}
        for name in dict.fromkeys(v for m in models for v in m.voices):  # in order, once
            if name in own:
                self.voices[name] = Voice(name, None, None)
                continue
            clip, text = folder / f"{name}.wav", folder / f"{name}.txt"
            if not clip.is_file() or not text.is_file():
                raise StageConfigError(
                    f"voice {name!r}: {folder} needs {clip.name} and {text.name} (a reference "
                    "clip and its transcript)"
                )
            transcript = text.read_text(encoding="utf-8").strip()
            if not transcript:
                raise StageConfigError(f"voice {name!r}: {text} is empty")
            self.voices[name] = Voice(name, clip, transcript)

    def lookup(self, name: str, reference: VoiceReference | None = None) -> Voice:
        if reference is not None:  # a custom voice: the server found it in its store
            return Voice(name, Path(reference.path), reference.transcript.strip(), custom=True)
        voice = self.voices.get(name)
        if voice is None:  # the server checked the name against the model's voices
            raise InvalidRequest(
                f"unknown voice {name!r}; voices: {', '.join(self.voices)}", param="voice"
            )
        return voice


class Preprocessing(StageBackend):
    def initialize(self, context: StageContext) -> None:
        try:
            checkpoint = open_checkpoint(context.repository_parameters)
        except HiggsCheckpointError as err:
            raise StageConfigError(str(err)) from err
        self.tokenizer = HFTokenizer(checkpoint.folder)
        self.system = str(context.parameters.get("system", ""))
        self.scene = str(context.parameters.get("scene", ""))
        self.voices = VoiceLibrary(context.repository / "voices", context.models.values())

    def execute(self, requests: list[Any]) -> list[dict[str, Any]]:
        return [self._one(request.inputs) for request in requests]

    def _one(self, inputs: dict[str, Any]) -> dict[str, Any]:
        text = inputs.get("text")
        if not isinstance(text, str) or not text.strip():
            raise InvalidRequest("'input' is empty", param="input")
        speech = SpeechOptions.of(inputs)
        voice = self.voices.lookup(speech.voice, speech.reference)
        conversation = self.conversation(text, voice, speech.instructions)
        try:
            prompt_text = self.tokenizer.apply_chat_template(conversation)
        except ChatTemplateError as err:
            raise InvalidRequest(str(err), param="input") from err
        return {
            # what is spoken, for a word_timing stage after the vocoder to align the audio to;
            # None when the caller shows no timing (the alignment costs a Whisper pass)
            "text": text if speech.timing else None,
            "conversation": conversation,
            "prompt_text": prompt_text,
            "voice": {
                "name": voice.name,
                "clip": None if voice.clip is None else str(voice.clip),
                "transcript": voice.transcript,
                "custom": voice.custom,
            },
            "sampling": {"temperature": speech.temperature, "seed": speech.seed},
            "encoding": {
                "format": speech.response_format,
                "stream": speech.stream,
                "sample_rate": speech.sample_rate,
                "speed": speech.speed,
            },
        }

    def conversation(
        self, text: str, voice: Voice, instructions: str | None
    ) -> list[dict[str, Any]]:
        system = instructions or self.system
        messages: list[dict[str, Any]] = [_turn("system", system)]
        if self.scene:
            messages.append(_turn("scene", self.scene))
        if voice.clip is not None:
            messages.append(_turn("user", voice.transcript or ""))
            messages.append({"role": "assistant", "content": [{"type": "audio", "url": "voice"}]})
        messages.append(_turn("user", text))
        return messages


def _turn(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "content": [{"type": "text", "text": text}]}
