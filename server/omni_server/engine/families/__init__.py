"""Model families: how a checkpoint becomes a module and what its step emits. One folder per
family (its module, its checkpoint names, its head when a step emits more than a text token),
the seam in base.py; `FAMILIES` maps a config's `model_type` (or a GGUF's
`general.architecture`) to its family. docs/engine.md, "Adding a family", walks through one.

A family answers four questions, each checked before any weight is placed (engine/checkpoint.py
asks them in this order):

    read(config, folder)       config.json -> Architecture (the Llama shape, the audio head if
                               any); CheckpointError for a field it cannot honour
    expected_weights(spec)     checkpoint tensor name -> shape, as the config implies
    build(spec, positions, tp) the module (on the meta device while loading: no memory yet),
                               whose `head` says what a step emits (engine/head.py)
    load(model, tensors, spec) checkpoint-named tensors -> the module's parameters (renamed,
                               Q/K rows reordered, fused)

and, where it reads GGUF files too, `open_gguf` (families/llama/gguf.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omni_server.engine.errors import CheckpointError
from omni_server.engine.families.base import (
    Architecture,
    Family,
    FamilyModel,
    LazyWeights,
    ModelSource,
    TensorSource,
)
from omni_server.engine.families.higgs_audio_v2.checkpoint import HiggsAudioV2Family
from omni_server.engine.families.llama.checkpoint import LlamaFamily
from omni_server.engine.families.llama.gguf import GGUFFormatError, read_metadata
from omni_server.engine.families.qwen3_omni_moe.checkpoint import Qwen3OmniMoeFamily

__all__ = [
    "FAMILIES",
    "Architecture",
    "Family",
    "FamilyModel",
    "LazyWeights",
    "ModelSource",
    "TensorSource",
    "family_for",
    "open_gguf",
]


def _registry() -> dict[str, Family]:
    families: list[Family] = [LlamaFamily(), HiggsAudioV2Family(), Qwen3OmniMoeFamily()]
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


def open_gguf(path: Path) -> ModelSource:
    """A GGUF file, by the family its `general.architecture` names; its header read, nothing
    dequantized (GGUFFormatError when no family reads it)."""
    from gguf import GGUFReader  # random-weight engines (GPU benchmarks) need no gguf package

    reader = GGUFReader(path)  # maps the file
    metadata = read_metadata(reader)
    arch = metadata.get("general.architecture")
    readers = {f.gguf_architecture: f for f in FAMILIES.values() if f.gguf_architecture}
    family = readers.get(arch) if isinstance(arch, str) else None
    if family is None:
        expected = " or ".join(repr(a) for a in sorted(readers))
        raise GGUFFormatError(f"{path}: general.architecture is {arch!r}, expected {expected}")
    return family.open_gguf(path, reader, metadata)
