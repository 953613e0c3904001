"""Model families: how a checkpoint folder's config.json becomes a shape, how its weights are
named, which module runs it. One file per family; `FAMILIES` maps a config's `model_type` to its
family (a Qwen2 / Qwen3 dense model is one more file and one more entry).

A family answers four questions, each checked before any weight is placed (engine/checkpoint.py
asks them in this order):

    read(config, folder)       config.json -> ModelSpec (the Llama shape, the audio head if any);
                               CheckpointError for a field it cannot honour
    expected_weights(spec)     checkpoint tensor name -> shape, as the config implies
    build(spec, positions, tp) the module (on the meta device while loading: no memory yet)
    load(model, tensors, spec) checkpoint-named tensors -> the module's parameters (renamed,
                               Q/K rows reordered, fused)
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omni_server.engine.audio_frames import AudioSpec
from omni_server.engine.config import LlamaShape
from omni_server.engine.errors import CheckpointError
from omni_server.engine.llama import Llama
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


def _registry() -> dict[str, Family]:
    from omni_server.engine.families.higgs_audio_v2 import HiggsAudioV2Family
    from omni_server.engine.families.llama import LlamaFamily

    families: list[Family] = [LlamaFamily(), HiggsAudioV2Family()]
    return {model_type: f for f in families for model_type in f.model_types}


FAMILIES: dict[str, Family] = _registry()


def family_for(config: Mapping[str, Any], folder: Path) -> Family:
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise CheckpointError(folder, "config.json has no model_type")
    family = FAMILIES.get(model_type)
    if family is None:
        raise CheckpointError(
            folder, f"model_type {model_type!r} is not supported (supported: {sorted(FAMILIES)})"
        )
    return family
