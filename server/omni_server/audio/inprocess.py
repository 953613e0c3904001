"""The embedded voice run in this thread, stage by stage, without the runtime.

`load_stage()` builds one stage's backend from its folder exactly as a stage host would (the
`backend` field of stage.toml, its `[parameters]`, then `initialize()`), and `InProcessVoice`
chains the embedded repository's three stages the way the pipeline does: text_frontend's
execute(), then acoustic's generate() feeding audio_encoder's request stream. The voice tests
drive it, and the benchmark uses it as the floor a served request is compared with.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
import tomllib
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_server.backend import Payload, Request, StageContext

_loaded = itertools.count()


def load_stage(
    stage_dir: Path, *, parameters: Mapping[str, Any] | None = None, replica: int = 0
) -> Any:
    """Import the stage's backend class (a fresh module each call) and initialize it on CPU.

    `parameters` override keys of the stage's [parameters].
    """
    stage_dir = Path(stage_dir).resolve()
    descriptor = tomllib.loads((stage_dir / "stage.toml").read_text(encoding="utf-8"))
    file, _, class_name = descriptor["backend"].rpartition(":")
    spec = importlib.util.spec_from_file_location(
        f"omni_stage_{stage_dir.name}_{next(_loaded)}", stage_dir / (file or "model.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    backend = getattr(module, class_name)()
    backend.initialize(
        StageContext(
            stage=stage_dir.name,
            parameters={**descriptor.get("parameters", {}), **(parameters or {})},
            device="cpu",
            repository=stage_dir.parent,
            stage_dir=stage_dir,
            replica=replica,
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


class InProcessVoice:
    """The repository's text_frontend -> acoustic -> audio_encoder chain, in the calling thread.

    Several threads may use one instance at once: espeak-ng calls are serialized by the
    frontend, onnxruntime sessions are thread-safe, and every request has its own generator,
    noise generator and encoder.
    """

    def __init__(self, repository: Path, *, acoustic: Mapping[str, Any] | None = None) -> None:
        repository = Path(repository)
        self.frontend = load_stage(repository / "text_frontend")
        self.acoustic = load_stage(repository / "acoustic", parameters=acoustic)
        self.encoder = load_stage(repository / "audio_encoder")
        self._ids = itertools.count()

    def request(
        self,
        text: str,
        *,
        voice: str = "joe",
        speed: float = 1.0,
        seed: int | None = None,
        response_format: str = "wav",
        stream: bool = False,
        sample_rate: int | None = None,
    ) -> Payload:
        """The entry stage's inputs, as the speech endpoint sends them."""
        return {
            "text": text,
            "voice": voice,
            "speed": speed,
            "seed": seed,
            "response_format": response_format,
            "stream": stream,
            "sample_rate": sample_rate,
        }

    def frontend_payload(self, inputs: Payload) -> Payload:
        [out] = self.frontend.execute([Request(id=f"r{next(self._ids)}", inputs=inputs)])
        if isinstance(out, Exception):
            raise out
        return out

    def sentences(self, inputs: Payload) -> Generator[Payload, None, Payload]:
        """The acoustic stage's chunks (one per sentence); returns its `next` payload."""
        payload = self.frontend_payload(inputs)
        return (
            yield from self.acoustic.generate(Request(id=f"r{next(self._ids)}", inputs=payload))
        )

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
