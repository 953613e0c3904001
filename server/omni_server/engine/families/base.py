"""The family seam: what a model family is (`Family`), what a checkpoint's config says the model
is (`ModelSpec`), and weights read only when the model asks for them (`LazyWeights`). The
registry of families is the package (`families/__init__.py`)."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omni_server.engine.config import LlamaShape
from omni_server.engine.families.higgs_audio_v2.frames import AudioSpec
from omni_server.engine.families.llama.model import Llama
from omni_server.engine.parallel import TensorParallel


@dataclass(frozen=True)
class ModelSpec:
    """What a checkpoint's config.json says the model is."""

    shape: LlamaShape  # the decoder (a Higgs backbone is a Llama)
    audio: AudioSpec | None = None  # an audio-frame head (higgs_audio_v2), else text logits


# A checkpoint tensor by name, read when called.
TensorSource = Callable[[str], torch.Tensor]


class LazyWeights(Mapping[str, torch.Tensor]):
    """Engine-named weights, each read (and converted) from the checkpoint only when the model's
    load_weights asks for it and dropped after its copy: a 5B model's float32 copy never sits
    whole in host memory."""

    def __init__(self) -> None:
        self._read: dict[str, Callable[[], torch.Tensor]] = {}

    def add(self, name: str, read: Callable[[], torch.Tensor]) -> None:
        self._read[name] = read

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._read[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._read)

    def __len__(self) -> int:
        return len(self._read)


class Family(abc.ABC):
    name: str
    model_types: tuple[str, ...]
    # checkpoint tensors the engine does not use (a training-only head): neither missing nor extra
    ignored_weights: tuple[str, ...] = ()

    @abc.abstractmethod
    def read(self, config: Mapping[str, Any], folder: Path) -> ModelSpec: ...

    @abc.abstractmethod
    def expected_weights(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]: ...

    @abc.abstractmethod
    def build(self, spec: ModelSpec, max_positions: int, tp: TensorParallel) -> Llama: ...

    @abc.abstractmethod
    def load(self, model: Llama, tensors: TensorSource, spec: ModelSpec) -> None: ...
