"""The Higgs Audio v2 family (`model_type: "higgs_audio_v2"`, transformers'
`HiggsAudioV2ForConditionalGeneration`): a Llama-3.2 backbone (the llama family's shape, names and
Q/K reordering under `model.`), a DualFFN per layer, the audio codebook embeddings and
`audio_lm_head`. `text_lm_head.weight`, which the published checkpoint carries, is not loaded (the
reference does not load it for generation either).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omni_server.engine.errors import CheckpointError
from omni_server.engine.families.base import Architecture, Family, FamilyModel, TensorSource
from omni_server.engine.families.higgs_audio_v2.frames import AudioSpec
from omni_server.engine.families.higgs_audio_v2.model import HiggsAudioV2
from omni_server.engine.families.llama.checkpoint import (
    llama_engine_weights,
    llama_weight_shapes,
    read_llama_shape,
)
from omni_server.engine.parallel import TensorParallel

# transformers' name of each per-layer audio tensor -> the engine's (HiggsAudioV2.load_weights)
AUDIO_LAYER_TENSORS = {
    "audio_input_layernorm.weight": "audio_attn_norm",
    "audio_post_attention_layernorm.weight": "audio_ffn_norm",
    "audio_mlp.gate_proj.weight": "audio_w_gate",
    "audio_mlp.up_proj.weight": "audio_w_up",
    "audio_mlp.down_proj.weight": "audio_w_down",
}
EMBED_AUDIO = "model.embed_audio_tokens.embed_audio_tokens.weight"
AUDIO_HEAD = "audio_lm_head.weight"

# transformers' HiggsAudioV2Config defaults (a config.json saved by it writes them all anyway)
DEFAULTS = {
    "num_codebooks": 8,
    "codebook_size": 1024,
    "audio_token_id": 128016,
    "audio_bos_token_id": 128013,
    "audio_delay_token_id": 128014,
    "audio_stream_bos_id": 1024,
    "audio_stream_eos_id": 1025,
    "eos_token_id": 128009,
}


def read_audio_spec(config: Mapping[str, Any], folder: Path) -> AudioSpec:
    value = {k: config.get(k, d) for k, d in DEFAULTS.items()}
    eos = value["eos_token_id"]
    if isinstance(eos, list):  # the reference assigns it to one position: one id
        eos = eos[0] if eos else None
    spec = AudioSpec(
        num_codebooks=int(value["num_codebooks"]),
        codebook_size=int(value["codebook_size"]),
        stream_bos_id=int(value["audio_stream_bos_id"]),
        stream_eos_id=int(value["audio_stream_eos_id"]),
        audio_token_id=int(value["audio_token_id"]),
        audio_bos_token_id=int(value["audio_bos_token_id"]),
        audio_delay_token_id=int(value["audio_delay_token_id"]),
        eos_token_id=None if eos is None else int(eos),
    )
    for name in ("stream_bos_id", "stream_eos_id"):
        if not 0 <= getattr(spec, name) < spec.codebook_size:
            raise CheckpointError(
                folder,
                f"audio_{name} {getattr(spec, name)} is not a code of a codebook of "
                f"codebook_size {spec.codebook_size} (the published config has 1026: 1024 + 2)",
            )
    return spec


@dataclass(frozen=True)
class HiggsArchitecture(Architecture):
    """The Llama backbone's shape and the audio head."""

    audio: AudioSpec


class HiggsAudioV2Family(Family):
    name = "higgs_audio_v2"
    model_types = ("higgs_audio_v2",)
    ignored_weights = ("text_lm_head.weight", "rotary_emb.inv_freq")

    def read(self, config: Mapping[str, Any], folder: Path) -> HiggsArchitecture:
        shape = read_llama_shape(config, folder)
        return HiggsArchitecture(shape, read_audio_spec(config, folder))

    def expected_weights(self, spec: Architecture) -> dict[str, tuple[int, ...]]:
        assert isinstance(spec, HiggsArchitecture)
        shape, audio = spec.shape, spec.audio
        c, inter = shape.hidden_size, shape.intermediate_size
        frame = audio.num_codebooks * audio.codebook_size
        names = llama_weight_shapes(shape)
        names[EMBED_AUDIO] = (frame, c)
        names[AUDIO_HEAD] = (frame, c)
        per_layer = {
            "audio_input_layernorm.weight": (c,),
            "audio_post_attention_layernorm.weight": (c,),
            "audio_mlp.gate_proj.weight": (inter, c),
            "audio_mlp.up_proj.weight": (inter, c),
            "audio_mlp.down_proj.weight": (c, inter),
        }
        for i in range(shape.num_layers):
            names.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
        return names

    def build(self, spec: Architecture, max_positions: int, tp: TensorParallel) -> HiggsAudioV2:
        assert isinstance(spec, HiggsArchitecture)
        return HiggsAudioV2(spec.shape, spec.audio, max_positions=max_positions, tp=tp)

    def load(self, model: FamilyModel, tensors: TensorSource, spec: Architecture) -> None:
        weights = llama_engine_weights(tensors, spec.shape)

        def read(name: str) -> Callable[[], torch.Tensor]:
            return lambda: tensors(name).float()

        weights.add("embed_audio", read(EMBED_AUDIO))
        weights.add("audio_head", read(AUDIO_HEAD))
        for i in range(spec.shape.num_layers):
            for hf, ours in AUDIO_LAYER_TENSORS.items():
                weights.add(f"layers.{i}.{ours}", read(f"model.layers.{i}.{hf}"))
        model.load_weights(weights)
