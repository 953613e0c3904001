"""The Llama family (`model_type: "llama"`): config.json -> LlamaShape, transformers' tensor names
-> the engine's.

transformers' Llama rotates the halves of each head `(x[i], x[i + D/2])`; the engine rotates
adjacent pairs `(x[2i], x[2i+1])` (the GGUF row order, model.py). Loading reorders the rows of
q_proj / k_proj within each head (half-major -> pair-major: llama.cpp's converter permutation),
which is exact: the same permutation of Q and K leaves every `q . k` unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from omni_server.engine.config import Llama3RopeScaling, LlamaShape
from omni_server.engine.errors import CheckpointError
from omni_server.engine.families.base import (
    Architecture,
    Family,
    FamilyModel,
    LazyWeights,
    ModelSource,
    TensorSource,
)
from omni_server.engine.families.llama.model import Llama
from omni_server.engine.parallel import TensorParallel

if TYPE_CHECKING:
    from gguf import GGUFReader

# transformers' name of each per-layer tensor -> the engine's (Llama.load_weights names)
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}


def read_llama_shape(config: Mapping[str, Any], folder: Path) -> LlamaShape:
    """The decoder's shape from a transformers Llama-style config.json (CheckpointError naming the
    field when one is missing or asks for something the engine does not run)."""

    def need(name: str) -> Any:
        if name not in config or config[name] is None:
            raise CheckpointError(folder, f"config.json has no {name}")
        return config[name]

    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(folder, f"hidden_act {config['hidden_act']!r} (only silu runs)")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise CheckpointError(folder, f"{flag} is true (the engine's Llama has no biases)")
    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    rope = _rope(config, folder)
    try:
        return LlamaShape(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(need("max_position_embeddings")),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_scaling=_llama3_scaling(rope, folder),
        )
    except ValueError as err:  # LlamaShape's own checks (heads, head_dim)
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(folder, f"config.json: {err}") from err


def _rope(config: Mapping[str, Any], folder: Path) -> dict[str, Any]:
    """transformers 5's `rope_parameters`, or the older `rope_theta` + `rope_scaling` pair."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping):
        if "rope_theta" not in params and "full_attention" in params:  # per-layer-type form
            raise CheckpointError(folder, "per-layer-type rope_parameters are not supported")
        return dict(params)
    rope: dict[str, Any] = {"rope_theta": config.get("rope_theta", 10000.0)}
    scaling = config.get("rope_scaling")
    if isinstance(scaling, Mapping):
        rope.update(scaling)
    return rope


def _llama3_scaling(rope: Mapping[str, Any], folder: Path) -> Llama3RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise CheckpointError(folder, f"rope_type {kind!r} is not supported (default, llama3)")
    try:
        return Llama3RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    except KeyError as err:
        raise CheckpointError(folder, f"llama3 rope parameters lack {err.args[0]}") from err


def llama_weight_shapes(shape: LlamaShape, prefix: str = "model.") -> dict[str, tuple[int, ...]]:
    """transformers' tensor names of a Llama decoder -> their shapes."""
    c, d = shape.hidden_size, shape.head_dim
    q, kv, inter = shape.num_heads * d, shape.num_kv_heads * d, shape.intermediate_size
    per_layer = {
        "input_layernorm.weight": (c,),
        "post_attention_layernorm.weight": (c,),
        "self_attn.q_proj.weight": (q, c),
        "self_attn.k_proj.weight": (kv, c),
        "self_attn.v_proj.weight": (kv, c),
        "self_attn.o_proj.weight": (c, q),
        "mlp.gate_proj.weight": (inter, c),
        "mlp.up_proj.weight": (inter, c),
        "mlp.down_proj.weight": (c, inter),
    }
    names = {f"{prefix}embed_tokens.weight": (shape.vocab_size, c), f"{prefix}norm.weight": (c,)}
    for i in range(shape.num_layers):
        names.update({f"{prefix}layers.{i}.{k}": v for k, v in per_layer.items()})
    return names


def pairs_from_halves(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[H * D, C] rows of each head from (first half, second half) order to interleaved pairs."""
    rows, cols = w.shape
    half = rows // num_heads // 2
    return w.view(num_heads, 2, half, cols).transpose(1, 2).reshape(rows, cols)


def llama_engine_weights(
    tensors: TensorSource, shape: LlamaShape, prefix: str = "model."
) -> LazyWeights:
    """Checkpoint tensors -> Llama.load_weights names (float32; Q/K rows in pair order), read
    as the model asks for them."""
    out = LazyWeights()

    def read(name: str, heads: int = 0) -> Callable[[], torch.Tensor]:
        def value() -> torch.Tensor:
            w = tensors(name).float()
            return pairs_from_halves(w, heads) if heads else w

        return value

    out.add("embed", read(f"{prefix}embed_tokens.weight"))
    out.add("norm", read(f"{prefix}norm.weight"))
    for i in range(shape.num_layers):
        for hf, ours in LAYER_TENSORS.items():
            heads = {"wq": shape.num_heads, "wk": shape.num_kv_heads}.get(ours, 0)
            out.add(f"layers.{i}.{ours}", read(f"{prefix}layers.{i}.{hf}", heads))
    return out


class LlamaFamily(Family):
    name = "llama"
    model_types = ("llama",)
    ignored_weights = (
        "lm_head.weight",
        "rotary_emb.inv_freq",
    )  # a tied head saved anyway; old buffers
    gguf_architecture = "llama"

    def read(self, config: Mapping[str, Any], folder: Path) -> Architecture:
        return Architecture(read_llama_shape(config, folder))

    def expected_weights(self, spec: Architecture) -> dict[str, tuple[int, ...]]:
        names = llama_weight_shapes(spec.shape)
        if not spec.shape.tie_word_embeddings:
            names["lm_head.weight"] = (spec.shape.vocab_size, spec.shape.hidden_size)
        return names

    def build(self, spec: Architecture, max_positions: int, tp: TensorParallel) -> Llama:
        return Llama(spec.shape, max_positions=max_positions, tp=tp)

    def load(self, model: FamilyModel, tensors: TensorSource, spec: Architecture) -> None:
        weights = llama_engine_weights(tensors, spec.shape)
        if not spec.shape.tie_word_embeddings:
            weights.add("lm_head", lambda: tensors("lm_head.weight").float())
        model.load_weights(weights)

    def open_gguf(self, path: Path, reader: GGUFReader, metadata: dict[str, Any]) -> ModelSource:
        from omni_server.engine.families.llama.gguf import GGUFFile

        return GGUFFile.read(self, path, reader, metadata)
