"""Model families: how a checkpoint folder's config.json becomes a shape, how its weights are
named, which module runs it. One file per family, the seam in base.py; `FAMILIES` maps a
config's `model_type` to its family (a Qwen2 / Qwen3 dense model is one more file and one more
entry).

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

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omni_server.engine.errors import CheckpointError
from omni_server.engine.families.base import Family, LazyWeights, ModelSpec, TensorSource
from omni_server.engine.families.higgs_audio_v2.checkpoint import HiggsAudioV2Family
from omni_server.engine.families.llama.checkpoint import LlamaFamily

__all__ = ["FAMILIES", "Family", "LazyWeights", "ModelSpec", "TensorSource", "family_for"]


def _registry() -> dict[str, Family]:
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
