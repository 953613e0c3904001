"""The voices a model speaks in: the ones its repository declares, and the custom voices stored
for its cloning stage; the one voice lookup of every endpoint that speaks (speech, chat with
audio, realtime, the speech input stream).

A model clones when one of the stages its requests visit declares `voice_cloning = true`
(stage.toml): that stage is the scope of the custom voices made for it, so every model through
it (a speech model and an omni model sharing one voice stage) speaks in them. A custom voice
reaches the pipeline as the speech contract's `voice` (its id) plus `reference`, the clip and
its transcript (docs/voices.md, "The cloning seam").

A request names its voice as `Voice` (a name, or OpenAI's object `{"id": name}`); `choose_voice`
is every speaking endpoint's one check of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Discriminator

from omni_server.compiler.plan import ModelSpec, Plan
from omni_server.contracts import ChatInput, SpeechOptions, VoiceReference
from omni_server.errors import PipelineError
from omni_server.serve.errors import invalid_field
from omni_server.serve.validation import RequestModel, names, tag
from omni_server.serve.voice_store import StoredVoice, VoiceGone, VoiceStore

SPEAKING_TASKS = frozenset({"speech", "chat", "realtime"})


@dataclass(frozen=True)
class VoiceChoice:
    """A request's voice: `name` is the speech contract's `voice` (a declared voice or a custom
    voice's id); `reference` is the clip a cloning stage speaks from (None: a declared voice)."""

    name: str
    reference: VoiceReference | None = None


class VoiceCatalog:
    def __init__(
        self, plan: Plan | Callable[[], Plan] | None, store: VoiceStore | None = None
    ) -> None:
        # a callable: the plan as it is now (model control swaps it while the server runs)
        self._plan, self.store = plan, store

    @property
    def plan(self) -> Plan | None:
        return self._plan() if callable(self._plan) else self._plan

    @classmethod
    def declared_only(cls) -> VoiceCatalog:
        """The voices the repository declares, no custom ones (for callers without an app)."""
        return cls(None)

    def cloning_stage(self, model: ModelSpec) -> str | None:
        """The stage of the model that clones voices, or None (it speaks only its own)."""
        if self.plan is None:
            return None
        stages = model.stages or (model.entry,)
        return next((s for s in stages if self.plan.stages[s].voice_cloning), None)

    def speaks(self, model: ModelSpec) -> bool:
        return bool(SPEAKING_TASKS.intersection(model.tasks)) and (
            bool(model.voices) or self.cloning_stage(model) is not None
        )

    def speaking_models(self) -> list[ModelSpec]:
        models = self.plan.models.values() if self.plan is not None else ()
        return [m for m in models if self.speaks(m)]

    def custom(self, model: ModelSpec) -> list[StoredVoice]:
        scope = self.cloning_stage(model)
        return [] if scope is None or self.store is None else self.store.in_scope(scope)

    def resolve(self, model: ModelSpec, raw: str) -> VoiceChoice | None:
        """The voice `raw` names for `model` (a voice, an alias, a custom voice id), or None."""
        if raw in model.voices:
            return VoiceChoice(raw)
        if raw in model.voice_aliases:
            return VoiceChoice(model.voice_aliases[raw])
        stored = self.store.get(raw) if self.store is not None else None
        if stored is None or stored.scope != self.cloning_stage(model):
            return None
        return VoiceChoice(stored.id, self.reference(stored))

    def reference(self, voice: StoredVoice) -> VoiceReference:
        """The speech contract's `reference` of a custom voice (docs/voices.md)."""
        assert self.store is not None
        return VoiceReference(
            id=voice.id,
            path=str(self.store.clip_path(voice.id)),
            transcript=voice.transcript,
            sample_rate=voice.sample_rate,
            language=voice.language,
        )

    @contextlib.contextmanager
    def held_for(self, inputs: Mapping[str, Any]) -> Iterator[None]:
        """Keep the clip of the custom voice a request's inputs speak in (the speech contract's
        `reference`, whole or inside the thinker's) on disk for the block: the request was
        admitted in it, so it finishes even if the voice is deleted meanwhile. A voice
        deleted since the request named it is PipelineError `invalid_request` (a 400,
        `voice_not_found`): the request never starts."""
        reference = voice_reference(inputs)
        if reference is None or self.store is None:
            yield
            return
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self.store.held(reference.id))
            except VoiceGone:
                raise PipelineError(
                    f"the custom voice '{reference.id}' was deleted; choose another voice",
                    code="invalid_request",
                    error_code="voice_not_found",
                    param="voice",
                ) from None
            yield

    def names(self, model: ModelSpec) -> list[str]:
        """Every name a request may use for `model`: for error messages and session checks."""
        return [*model.voices, *model.voice_aliases, *(v.id for v in self.custom(model))]

    def listing(self, model: ModelSpec) -> list[dict[str, Any]]:
        """`GET /v1/audio/voices` entries of one model: its declared voices, then custom ones."""
        entries = [
            {
                "id": voice,
                "object": "voice",
                "model": model.id,
                "name": voice,
                "language": model.language,
                "aliases": [a for a, v in model.voice_aliases.items() if v == voice],
                "default": voice == model.default_voice,
                "custom": False,
            }
            for voice in model.voices
        ]
        entries += [custom_entry(v, model.id) for v in self.custom(model)]
        return entries


def voice_reference(inputs: Mapping[str, Any]) -> VoiceReference | None:
    """The custom voice's clip a request's inputs carry: a speech entry's `speech`, or the
    thinker's `chat` with the voice's options (None: a declared voice, or no speech)."""
    chat = inputs.get(ChatInput.KEY)
    speech = chat.speech if isinstance(chat, ChatInput) else inputs.get(SpeechOptions.KEY)
    return speech.reference if isinstance(speech, SpeechOptions) else None


class VoiceId(RequestModel):
    """OpenAI's object form of `voice` (its custom voices)."""

    id: str


def _voice_kind(value: Any) -> str | None:
    # an object without "id" is no voice object: refused as a whole, not as a missing "id"
    if isinstance(value, str):
        return "<string>"
    return "<object>" if isinstance(value, dict) and "id" in value else None


# a request's voice field (speech's `voice`, chat's `audio.voice`)
Voice = Annotated[
    Annotated[str, tag("string")] | Annotated[VoiceId, tag("object")],
    Discriminator(
        _voice_kind,
        custom_error_type="invalid_type",
        custom_error_message='must be a voice name or an object {"id": name}',
    ),
]


def choose_voice(
    sent: str | VoiceId, model: ModelSpec, voices: VoiceCatalog | None, param: str
) -> VoiceChoice:
    """The voice a request names (a name or `{"id": ...}`), for every endpoint that speaks;
    400 naming `param` and the valid voices when the model has no such voice."""
    raw = sent.id if isinstance(sent, VoiceId) else sent
    catalog = voices if voices is not None else VoiceCatalog.declared_only()
    choice = catalog.resolve(model, raw)
    if choice is None:
        raise invalid_field(
            param,
            f"unknown voice '{raw[:80]}' for model '{model.id}'; valid voices: "
            f"{names(catalog.names(model))}",
        )
    return choice


def custom_entry(voice: StoredVoice, model: str) -> dict[str, Any]:
    return {
        "id": voice.id,
        "object": "voice",
        "model": model,
        "name": voice.name,
        "language": voice.language,
        "aliases": [],
        "default": False,
        "custom": True,
    }
