"""The embedded voice run in this thread, stage by stage, without the runtime: the benchmark's
in-process floor, and how the voice tests drive the stages.

Everything a served request would go through up to the stages is the server's own code: the
repository is compiled (`compile_repository`), each backend is loaded by the runtime's loader
(`load_backend`) and initialized with the context a stage host gives it, and a request's entry
inputs follow the speech pipeline contract (the text and the typed `SpeechOptions` the speech
endpoint hands its model's entry stage). Only the runtime is left out: `InProcessVoice` chains
the speech model's three stream stages as the pipeline does: each stage's generate() feeds the
request stream of its `stream_to` stage.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_server.backend import Payload, Request, StageContext
from omni_server.compiler import ModelSpec, Plan, compile_repository
from omni_server.contracts import SpeechOptions, speech_payload
from omni_server.stage import load_backend


def load_stage(
    plan: Plan, stage: str, *, parameters: Mapping[str, Any] | None = None, replica: int = 0
) -> Any:
    """The stage's backend, loaded and initialized on CPU as a stage host would (a fresh module
    each call). `parameters` override keys of the stage's [parameters]."""
    spec = plan.stages[stage]
    backend = load_backend(spec)
    backend.initialize(
        StageContext(
            stage=spec.name,
            parameters={**spec.parameters, **(parameters or {})},
            device="cpu",
            repository=plan.repository,
            stage_dir=spec.directory,
            replica=replica,
            repository_parameters=dict(plan.parameters),
            models=plan.models_through(spec.name),
        )
    )
    return backend


@dataclass
class Speech:
    """A whole in-process answer: the body's chunks and the terminal result payload."""

    chunks: list[bytes]
    result: Payload

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


def speech_model(plan: Plan, model: str | None = None) -> ModelSpec:
    """The served model `model` (id or alias), or the repository's only speech model."""
    if model is not None:
        found = plan.model(model)
        if found is None:
            raise ValueError(
                f"{plan.repository}: no model {model!r}; served: {sorted(plan.models)}"
            )
        return found
    speech = [m for m in plan.models.values() if "speech" in m.tasks]
    if len(speech) != 1:
        raise ValueError(
            f"{plan.repository}: expected one speech model, found {[m.id for m in speech]}; "
            "name one"
        )
    return speech[0]


class InProcessVoice:
    """A speech model shaped frontend --stream_to--> acoustic --stream_to--> encoder (terminal),
    as the embedded repository's is, in the calling thread.

    Several threads may use one instance at once: espeak-ng calls are serialized by the
    frontend, onnxruntime sessions are thread-safe, and every request has its own generator,
    noise generator and encoder.
    """

    def __init__(
        self,
        repository: Path,
        *,
        model: str | None = None,
        acoustic: Mapping[str, Any] | None = None,
    ) -> None:
        self.plan = compile_repository(repository)
        self.model = speech_model(self.plan, model)
        frontend = self.plan.stages[self.model.entry]
        [acoustic_stage] = frontend.stream_to
        [encoder_stage] = self.plan.stages[acoustic_stage].stream_to
        self.frontend = load_stage(self.plan, frontend.name)
        self.acoustic = load_stage(self.plan, acoustic_stage, parameters=acoustic)
        self.encoder = load_stage(self.plan, encoder_stage)
        self._ids = itertools.count()

    def request(
        self,
        text: str,
        *,
        voice: str | None = None,
        speed: float = 1.0,
        seed: int | None = None,
        response_format: str = "wav",
        stream: bool = False,
        sample_rate: int | None = None,
    ) -> Payload:
        """The entry stage's inputs, as the speech endpoint builds them from a request with these
        fields (the voice by its canonical name; `stream`: the body may be encoded as it goes).
        The text is not checked as the endpoint would: the voice tests feed the stages texts
        the endpoint refuses ("..."), which other pipelines may still send them. The served
        clips transcribing exactly like these when seeded (tests/bench) keeps the two alike."""
        voice = voice or self.model.default_voice or self.model.voices[0]
        options = SpeechOptions(
            self.model.voice_aliases.get(voice, voice),
            response_format=response_format,
            stream=stream,
            speed=speed,
            seed=seed,
            sample_rate=sample_rate,
        )
        return speech_payload(text, options)

    def frontend_chunks(self, inputs: Payload) -> Iterator[Payload]:
        """The frontend's chunks (one per sentence) for entry inputs."""
        return self.frontend.generate(Request(id=f"r{next(self._ids)}", inputs=inputs))

    def sentences(self, inputs: Payload) -> Iterator[Payload]:
        """The acoustic stage's chunks (one per sentence)."""
        request = Request(id=f"r{next(self._ids)}", inputs={}, _stream=self.frontend_chunks(inputs))
        return self.acoustic.generate(request)

    def stream(self, inputs: Payload) -> Generator[bytes, None, Payload]:
        """Body bytes as the terminal stage yields them; returns its result payload."""
        chunks: Iterator[Payload] = self.sentences(inputs)
        request = Request(id=f"r{next(self._ids)}", inputs={}, _stream=chunks)
        generator = self.encoder.generate(request)
        while True:
            try:
                chunk = next(generator)
            except StopIteration as stop:
                return stop.value
            yield chunk["audio"]

    def speak(self, text: str, **options: Any) -> Speech:
        """Synthesize `text` whole (options as in request())."""
        chunks: list[bytes] = []
        generator = self.stream(self.request(text, **options))
        while True:
            try:
                chunks.append(next(generator))
            except StopIteration as stop:
                return Speech(chunks, stop.value)
