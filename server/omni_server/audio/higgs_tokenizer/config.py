"""The audio tokenizer's config.json (`model_type = "higgs_audio_v2_tokenizer"`, as transformers
saves it) read into plain frozen dataclasses: the sizes the modules are built from.

A field the file leaves out takes the default transformers gives it (its HiggsAudioV2Tokenizer
config, and the DAC / HuBERT sub-configs with the overrides HiggsAudioV2Tokenizer sets), so a
folder saved by any transformers 5 builds the same modules here as there. Variants the published
tokenizer does not use (another HuBERT layer norm order, a batch-normed positional conv, other
activations) are refused by name rather than built wrongly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL_TYPE = "higgs_audio_v2_tokenizer"


class TokenizerFolderError(ValueError):
    """An audio tokenizer folder that cannot be loaded; the message names the file and field."""


@dataclass(frozen=True)
class AcousticConfig:
    """The DAC encoder / decoder (`acoustic_model_config`)."""

    encoder_hidden_size: int
    downsampling_ratios: tuple[int, ...]
    decoder_hidden_size: int
    upsampling_ratios: tuple[int, ...]
    hidden_size: int  # the latent between encoder and decoder


@dataclass(frozen=True)
class SemanticConfig:
    """The HuBERT semantic model (`semantic_model_config`)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    conv_dim: tuple[int, ...]
    conv_kernel: tuple[int, ...]
    conv_stride: tuple[int, ...]
    conv_bias: bool
    num_conv_pos_embeddings: int
    num_conv_pos_embedding_groups: int
    feat_proj_layer_norm: bool
    layer_norm_eps: float


@dataclass(frozen=True)
class TokenizerConfig:
    sample_rate: int  # the codec's audio: 24 kHz
    semantic_sample_rate: int  # HuBERT's input: 16 kHz
    codebook_size: int
    codebook_dim: int
    num_quantizers: int
    hop_length: int  # samples a frame: the product of the DAC's downsampling ratios
    kernel_size: int  # the semantic encoder's stem
    unit_kernel_size: int
    channel_ratios: tuple[float, ...]
    strides: tuple[int, ...]
    block_dilations: tuple[int, ...]
    semantic_downsample_factor: int  # HuBERT frames a codec frame
    acoustic: AcousticConfig
    semantic: SemanticConfig

    @property
    def hidden_size(self) -> int:  # the quantized embedding: acoustic then semantic channels
        return self.acoustic.hidden_size + self.semantic.hidden_size


# transformers' defaults for fields config.json may leave out
TOP = {
    "target_bandwidths": [0.5, 1, 1.5, 2, 4], "sample_rate": 24000, "kernel_size": 3,
    "channel_ratios": [1, 1], "strides": [1, 1], "block_dilations": [1, 1],
    "unit_kernel_size": 3, "codebook_size": 1024, "codebook_dim": 64,
    "semantic_sample_rate": 16000, "downsample_factor": 320,
}  # fmt: skip
ACOUSTIC = {  # HiggsAudioV2Tokenizer's overrides of DacConfig
    "encoder_hidden_size": 64, "downsampling_ratios": [8, 5, 4, 2],
    "decoder_hidden_size": 1024, "upsampling_ratios": [8, 5, 4, 2], "hidden_size": 256,
}  # fmt: skip
SEMANTIC = {  # HubertConfig's
    "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
    "intermediate_size": 3072, "conv_dim": [512] * 7, "conv_kernel": [10, 3, 3, 3, 3, 2, 2],
    "conv_stride": [5, 2, 2, 2, 2, 2, 2], "conv_bias": False, "num_conv_pos_embeddings": 128,
    "num_conv_pos_embedding_groups": 16, "feat_proj_layer_norm": True, "layer_norm_eps": 1e-5,
}  # fmt: skip
# HuBERT variants this code builds: the field's only accepted value (the published model's)
SEMANTIC_FIXED = {
    "feat_extract_norm": "group", "do_stable_layer_norm": False, "conv_pos_batch_norm": False,
    "hidden_act": "gelu", "feat_extract_activation": "gelu",
}  # fmt: skip


def read_config(folder: Path) -> TokenizerConfig:
    path = folder / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as err:
        raise TokenizerFolderError(f"audio tokenizer {folder}: no config.json") from err
    except (OSError, ValueError) as err:
        raise TokenizerFolderError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(data, dict) or data.get("model_type") != MODEL_TYPE:
        raise TokenizerFolderError(f"{path}: model_type is not {MODEL_TYPE!r}")
    try:
        return _parse(data, path)
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, TokenizerFolderError):
            raise
        raise TokenizerFolderError(f"{path}: malformed ({err!r})") from err


def _parse(data: dict[str, Any], path: Path) -> TokenizerConfig:
    top = {**TOP, **data}
    acoustic_data = {**ACOUSTIC, **(data.get("acoustic_model_config") or {})}
    semantic_data = {**SEMANTIC, **(data.get("semantic_model_config") or {})}
    for key, value in SEMANTIC_FIXED.items():
        if semantic_data.get(key, value) != value:
            raise TokenizerFolderError(
                f"{path}: semantic_model_config.{key} is {semantic_data[key]!r}; this "
                f"tokenizer code builds {value!r} only (the published model's)"
            )
    acoustic = AcousticConfig(
        int(acoustic_data["encoder_hidden_size"]),
        tuple(int(r) for r in acoustic_data["downsampling_ratios"]),
        int(acoustic_data["decoder_hidden_size"]),
        tuple(int(r) for r in acoustic_data["upsampling_ratios"]),
        int(acoustic_data["hidden_size"]),
    )
    semantic = SemanticConfig(
        int(semantic_data["hidden_size"]),
        int(semantic_data["num_hidden_layers"]),
        int(semantic_data["num_attention_heads"]),
        int(semantic_data["intermediate_size"]),
        tuple(int(c) for c in semantic_data["conv_dim"]),
        tuple(int(c) for c in semantic_data["conv_kernel"]),
        tuple(int(c) for c in semantic_data["conv_stride"]),
        bool(semantic_data["conv_bias"]),
        int(semantic_data["num_conv_pos_embeddings"]),
        int(semantic_data["num_conv_pos_embedding_groups"]),
        bool(semantic_data["feat_proj_layer_norm"]),
        float(semantic_data["layer_norm_eps"]),
    )
    sample_rate, semantic_rate = int(top["sample_rate"]), int(top["semantic_sample_rate"])
    codebook_size = int(top["codebook_size"])
    hop = math.prod(acoustic.downsampling_ratios)
    frame_rate = math.ceil(sample_rate / hop)
    bandwidth = float(top["target_bandwidths"][-1])  # kbit/s: encode uses the highest
    # transformers' two counts: the modules built (bits rounded up) and the quantizers its
    # encode runs at the highest bandwidth (log2 of the size): codes need both to agree
    built = int(1000 * bandwidth // (frame_rate * math.ceil(math.log2(codebook_size))))
    used = max(1, math.floor(bandwidth / (math.log2(codebook_size) * frame_rate / 1000)))
    if built != used:
        raise TokenizerFolderError(
            f"{path}: target_bandwidths[-1] {bandwidth} gives {built} quantizers but encodes "
            f"with {used}"
        )
    if len(top["strides"]) != len(top["channel_ratios"]):
        raise TokenizerFolderError(f"{path}: strides and channel_ratios differ in length")
    return TokenizerConfig(
        sample_rate=sample_rate,
        semantic_sample_rate=semantic_rate,
        codebook_size=codebook_size,
        codebook_dim=int(top["codebook_dim"]),
        num_quantizers=built,
        hop_length=hop,
        kernel_size=int(top["kernel_size"]),
        unit_kernel_size=int(top["unit_kernel_size"]),
        channel_ratios=tuple(float(r) for r in top["channel_ratios"]),
        strides=tuple(int(s) for s in top["strides"]),
        block_dilations=tuple(int(d) for d in top["block_dilations"]),
        semantic_downsample_factor=int(
            hop / (sample_rate / semantic_rate) / int(top["downsample_factor"])
        ),
        acoustic=acoustic,
        semantic=semantic,
    )
