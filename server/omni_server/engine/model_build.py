"""Building an engine's model: its module on the meta device, or around given weights (a
sharing follower aliases its leader's tensors), and a GGUF's shape without its weights."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from omni_server.engine.config import EngineConfig, LlamaShape
from omni_server.engine.families.llama.gguf import (
    _engine_name,
    read_metadata,
    shape_from_metadata,
    smollm2_gguf_path,
)
from omni_server.engine.families.llama.model import Llama
from omni_server.engine.parallel import SINGLE, TensorParallel


def build_model(shape: LlamaShape, config: EngineConfig, tp: TensorParallel = SINGLE) -> Llama:
    limit = min(config.max_seq_len or shape.max_position_embeddings, shape.max_position_embeddings)
    return Llama(shape, max_positions=limit, tp=tp)


def with_weights(
    shape: LlamaShape, config: EngineConfig, tp: TensorParallel, weights: Mapping[str, torch.Tensor]
) -> Llama:
    """A model whose parameters are `weights` themselves (no copy: a sharing follower's
    tensors alias its leader's memory), after checking they are exactly the model's: the same
    names, shapes, dtype and device."""
    with torch.device("meta"):  # nothing allocated: every parameter is replaced below
        model = build_model(shape, config, tp)
    device = torch.device(config.device)
    expected = dict(model.named_parameters())
    if set(weights) != set(expected):
        missing, extra = set(expected) - set(weights), set(weights) - set(expected)
        raise ValueError(f"shared weights: missing {sorted(missing)}, unexpected {sorted(extra)}")
    for name, param in expected.items():
        value = weights[name]
        if value.shape != param.shape or value.dtype != config.torch_dtype:
            raise ValueError(
                f"shared weight {name}: {tuple(value.shape)} {value.dtype}, the model needs "
                f"{tuple(param.shape)} {config.torch_dtype}"
            )
        if value.device.type != device.type or (
            device.index is not None and value.device.index != device.index
        ):
            raise ValueError(f"shared weight {name} is on {value.device}, not {device}")
    model.load_state_dict(dict(weights), strict=True, assign=True)
    model.rope = model.rope.to(device)
    return model


def gguf_header(path: Path | str | None) -> tuple[LlamaShape, dict[str, Any]]:
    """A GGUF's shape and metadata without its weights (a sharing follower needs no more)."""
    from gguf import GGUFReader

    path = Path(path) if path is not None else smollm2_gguf_path()
    reader = GGUFReader(path)  # maps the file; nothing is dequantized
    metadata = read_metadata(reader)
    shape = shape_from_metadata(metadata, path)
    tied = all(_engine_name(t.name) != "lm_head" for t in reader.tensors)
    return LlamaShape(**{**shape.__dict__, "tie_word_embeddings": tied}), metadata
