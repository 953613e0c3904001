"""The voices a model speaks in: the ones its repository declares, and the custom voices stored
for its cloning stage; the one voice lookup of every endpoint that speaks (speech, chat with
audio, realtime, the speech input stream).

A model clones when one of the stages its requests visit declares `voice_cloning = true`
(stage.toml): that stage is the scope of the custom voices made for it, so every model through
it (a speech model and an omni model sharing one voice stage) speaks in them. A custom voice
reaches the pipeline as the speech contract's `voice` (its id) plus `reference`, the clip and
its transcript (docs/voices.md, "The cloning seam").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omni_server.compiler.plan import ModelSpec, Plan
from omni_server.serve.voice_store import StoredVoice, VoiceStore

SPEAKING_TASKS = frozenset({"speech", "chat", "realtime"})


@dataclass(frozen=True)
class VoiceChoice:
    """A request's voice: `name` is the speech contract's `voice` (a declared voice or a custom
    voice's id); `reference` is the clip a cloning stage speaks from (None: a declared voice)."""

    name: str
    reference: dict[str, Any] | None = None


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

    def reference(self, voice: StoredVoice) -> dict[str, Any]:
        """The speech contract's `reference` of a custom voice (docs/voices.md)."""
        assert self.store is not None
        return {
            "id": voice.id,
            "path": str(self.store.clip_path(voice.id)),
            "transcript": voice.transcript,
            "sample_rate": voice.sample_rate,
            "language": voice.language,
        }

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
