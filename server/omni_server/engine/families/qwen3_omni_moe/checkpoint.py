"""The qwen3_omni_moe family (`model_type: "qwen3_omni_moe"`): config.json's
`thinker_config.text_config` -> the thinker's shape; the checkpoint's `thinker.model.*` /
`thinker.lm_head.*` tensors -> Qwen3OmniThinker's names.

Only the thinker's text path runs here. The checkpoint's other tensors (the audio tower, the
talker, code2wav, any vision tower) are listed by `read` from the safetensors headers and
expected as found: the seam's `ignored_weights` matches whole names or suffixes, not a prefix
such as `talker.`, so they are named one by one. Their config is not checked here
(models/qwen3_omni reads them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from omni_server.engine.config import LlamaShape
from omni_server.engine.errors import CheckpointError
from omni_server.engine.families.base import (
    Architecture,
    Family,
    FamilyModel,
    LazyWeights,
    TensorSource,
)
from omni_server.engine.families.llama.checkpoint import pairs_from_halves
from omni_server.engine.families.qwen3_omni_moe.model import Qwen3OmniThinker
from omni_server.engine.parallel import TensorParallel
from omni_server.models.qwen3_omni.config import DecoderShape, decoder_shape

BODY = "thinker.model."  # the text decoder's tensors
HEAD = "thinker.lm_head.weight"

# the published name of each per-layer tensor -> the engine's (Qwen3OmniThinker.load_weights)
ATTENTION_TENSORS = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
}
DENSE_TENSORS = {
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
EXPERT_TENSORS = {"gate_proj": "experts_gate", "up_proj": "experts_up", "down_proj": "experts_down"}


@dataclass(frozen=True)
class ThinkerArchitecture(Architecture):
    """The thinker's Llama shape, its experts (`moe`), and the checkpoint's tensors outside the
    thinker's text path with their shapes (present, not loaded)."""

    moe: DecoderShape | None = None
    # talker_config.accept_hidden_layer: the layer whose input the talker hears
    tap_layer: int = 0
    other_weights: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


def read_thinker(config: Mapping[str, Any], folder: Path) -> tuple[LlamaShape, DecoderShape]:
    thinker = config.get("thinker_config")
    text = thinker.get("text_config") if isinstance(thinker, Mapping) else None
    if not isinstance(text, Mapping):
        raise CheckpointError(folder, "config.json has no thinker_config.text_config")
    if text.get("hidden_act", "silu") != "silu":
        raise CheckpointError(folder, f"hidden_act {text['hidden_act']!r} (only silu runs)")
    if text.get("attention_bias"):
        raise CheckpointError(folder, "thinker attention_bias is true (no biases here)")
    if text.get("sliding_window") and text.get("use_sliding_window"):
        raise CheckpointError(folder, "a sliding window is not supported")
    try:
        moe = decoder_shape(dict(text))
        shape = LlamaShape(
            vocab_size=moe.vocab_size,
            hidden_size=moe.hidden_size,
            intermediate_size=moe.intermediate_size or moe.moe_intermediate_size,
            num_layers=moe.num_layers,
            num_heads=moe.num_heads,
            num_kv_heads=moe.num_kv_heads,
            head_dim=moe.head_dim,
            rope_theta=moe.rope_theta,
            rms_norm_eps=moe.rms_norm_eps,
            max_position_embeddings=int(text.get("max_position_embeddings") or 32768),
            tie_word_embeddings=False,
        )
    except KeyError as err:
        raise CheckpointError(folder, f"thinker text_config has no {err.args[0]}") from err
    except ValueError as err:
        raise CheckpointError(folder, f"thinker text_config: {err}") from err
    if moe.shared_expert_size:
        raise CheckpointError(folder, "a shared expert in the thinker is not supported")
    return shape, moe


def _headers(folder: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open has keys(), no __iter__)
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except (SafetensorError, OSError) as err:
            raise CheckpointError(folder, f"{path.name} is not a safetensors file ({err})") from err
    return shapes


def thinker_weight_shapes(shape: LlamaShape, moe: DecoderShape) -> dict[str, tuple[int, ...]]:
    c, d = shape.hidden_size, shape.head_dim
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    names: dict[str, tuple[int, ...]] = {
        BODY + "embed_tokens.weight": (shape.vocab_size, c),
        BODY + "norm.weight": (c,),
        HEAD: (shape.vocab_size, c),
    }
    for i in range(shape.num_layers):
        w = f"{BODY}layers.{i}."
        names.update(
            {
                w + "input_layernorm.weight": (c,),
                w + "post_attention_layernorm.weight": (c,),
                w + "self_attn.q_proj.weight": (q, c),
                w + "self_attn.k_proj.weight": (kv, c),
                w + "self_attn.v_proj.weight": (kv, c),
                w + "self_attn.o_proj.weight": (c, q),
                w + "self_attn.q_norm.weight": (d,),
                w + "self_attn.k_norm.weight": (d,),
            }
        )
        if moe.is_moe(i):
            inter = moe.moe_intermediate_size
            names[w + "mlp.gate.weight"] = (moe.num_experts, c)
            for e in range(moe.num_experts):
                x = f"{w}mlp.experts.{e}."
                names[x + "gate_proj.weight"] = (inter, c)
                names[x + "up_proj.weight"] = (inter, c)
                names[x + "down_proj.weight"] = (c, inter)
        else:
            inter = shape.intermediate_size
            names[w + "mlp.gate_proj.weight"] = (inter, c)
            names[w + "mlp.up_proj.weight"] = (inter, c)
            names[w + "mlp.down_proj.weight"] = (c, inter)
    return names


def thinker_engine_weights(
    tensors: TensorSource,
    shape: LlamaShape,
    moe: DecoderShape,
    body: str = BODY,
    head: str = HEAD,
    embed: str = "embed_tokens.weight",
) -> LazyWeights:
    """Checkpoint tensors -> Qwen3OmniThinker.load_weights names (float32; Q / K rows and the
    QK-norm weights in pair order; each sparse layer's experts stacked), read when asked.
    `body` / `head` / `embed` (under body): another decoder of the same layout (the talker's)."""
    out = LazyWeights()

    def read(name: str, heads: int = 0) -> Callable[[], torch.Tensor]:
        def value() -> torch.Tensor:
            w = tensors(name).float()
            if not heads:
                return w
            if w.dim() == 1:  # a norm over one head's dimensions
                return pairs_from_halves(w[:, None], 1)[:, 0]
            return pairs_from_halves(w, heads)

        return value

    def stacked(prefix: str, which: str) -> Callable[[], torch.Tensor]:
        names = [f"{prefix}{e}.{which}.weight" for e in range(moe.num_experts)]
        return lambda: torch.stack([tensors(n).float() for n in names])

    out.add("embed", read(body + embed))
    out.add("norm", read(body + "norm.weight"))
    out.add("lm_head", read(head))
    heads = {"wq": shape.num_heads, "wk": shape.num_kv_heads, "q_norm": 1, "k_norm": 1}
    for i in range(shape.num_layers):
        w, ours = f"{body}layers.{i}.", f"layers.{i}."
        for theirs, name in ATTENTION_TENSORS.items():
            out.add(ours + name, read(w + theirs, heads.get(name, 0)))
        if moe.is_moe(i):
            out.add(ours + "router", read(w + "mlp.gate.weight"))
            for which, name in EXPERT_TENSORS.items():
                out.add(ours + name, stacked(f"{w}mlp.experts.", which))
        else:
            for theirs, name in DENSE_TENSORS.items():
                out.add(ours + name, read(w + theirs))
    return out


def _thinker(spec: Architecture) -> tuple[LlamaShape, DecoderShape, ThinkerArchitecture]:
    if not isinstance(spec, ThinkerArchitecture) or spec.moe is None:
        raise TypeError("the qwen3_omni_moe family builds from a ThinkerArchitecture")
    return spec.shape, spec.moe, spec


class Qwen3OmniMoeFamily(Family):
    name = "qwen3_omni_moe"
    model_types = ("qwen3_omni_moe",)

    def read(self, config: Mapping[str, Any], folder: Path) -> Architecture:
        shape, moe = read_thinker(config, folder)
        ours = thinker_weight_shapes(shape, moe)
        others = {n: s for n, s in _headers(folder).items() if n not in ours}
        talker = config.get("talker_config")
        tap = talker.get("accept_hidden_layer", 0) if isinstance(talker, Mapping) else 0
        if not (isinstance(tap, int) and 0 <= tap < shape.num_layers):
            raise CheckpointError(
                folder, f"talker_config.accept_hidden_layer {tap!r} is no thinker layer"
            )
        return ThinkerArchitecture(shape, moe, tap, others)

    def expected_weights(self, spec: Architecture) -> dict[str, tuple[int, ...]]:
        shape, moe, thinker = _thinker(spec)
        return {**thinker_weight_shapes(shape, moe), **thinker.other_weights}

    def build(self, spec: Architecture, max_positions: int, tp: TensorParallel) -> FamilyModel:
        shape, moe, thinker = _thinker(spec)
        return Qwen3OmniThinker(
            shape, moe, max_positions=max_positions, tp=tp, tap_layer=thinker.tap_layer
        )

    def load(self, model: FamilyModel, tensors: TensorSource, spec: Architecture) -> None:
        shape, moe, _ = _thinker(spec)
        model.load_weights(thinker_engine_weights(tensors, shape, moe))
