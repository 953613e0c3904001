"""config.json of a Qwen3-Omni folder -> the shapes and token ids the modules here need.

Both spellings of the rotary settings are read: `rope_parameters` (transformers 5) and
`rope_theta` + `rope_scaling` (the published config.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class DecoderShape:
    """One decoder stack: the thinker's text model, the talker's, or the code predictor."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's (layers without experts)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...] | None  # None: plain 1-D rotary (the code predictor)
    num_experts: int = 0  # 0: every layer dense
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k router weights to sum to 1
    shared_expert_size: int = 0  # the talker's always-on expert beside the routed ones
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1

    def is_moe(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )


def decoder_shape(text: dict[str, Any], mrope: bool = True) -> DecoderShape:
    rope = dict(text.get("rope_scaling") or {})
    rope.update(text.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    heads = int(text["num_attention_heads"])
    section = rope.get("mrope_section") if mrope else None
    return DecoderShape(
        vocab_size=int(text["vocab_size"]),
        hidden_size=int(text["hidden_size"]),
        intermediate_size=int(text.get("intermediate_size", 0)),
        num_layers=int(text["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or text["hidden_size"] // heads),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        mrope_section=tuple(int(s) for s in (section or [24, 20, 20])) if mrope else None,
        num_experts=int(text.get("num_experts", text.get("num_local_experts", 0)) or 0),
        top_k=int(text.get("num_experts_per_tok", 0) or 0),
        moe_intermediate_size=int(text.get("moe_intermediate_size", 0) or 0),
        norm_topk_prob=bool(text.get("norm_topk_prob", False)),
        shared_expert_size=int(text.get("shared_expert_intermediate_size", 0) or 0),
        mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
        decoder_sparse_step=int(text.get("decoder_sparse_step", 1) or 1),
    )


@dataclass(frozen=True)
class AudioEncoderShape:
    num_mel_bins: int
    d_model: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    output_dim: int
    downsample_hidden_size: int
    n_window: int  # mel frames per conv chunk: 2 * n_window
    n_window_infer: int  # mel frames per attention window
    max_source_positions: int


@dataclass(frozen=True)
class Code2WavShape:
    codebook_size: int
    num_quantizers: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    sliding_window: int
    rms_norm_eps: float
    rope_theta: float
    upsample_rates: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]
    decoder_dim: int

    @property
    def samples_per_frame(self) -> int:
        product = 1
        for factor in (*self.upsample_rates, *self.upsampling_ratios):
            product *= factor
        return product


@dataclass(frozen=True)
class TalkerIds:
    """The codec ids and the thinker-side ids the talker's input is built from."""

    num_code_groups: int
    accept_hidden_layer: int  # the thinker layer whose output the talker hears
    codec_pad: int
    codec_bos: int
    codec_eos: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int
    speakers: dict[str, int]


@dataclass(frozen=True)
class Qwen3OmniConfig:
    thinker: DecoderShape
    audio: AudioEncoderShape
    talker: DecoderShape
    code_predictor: DecoderShape
    code2wav: Code2WavShape
    talker_ids: TalkerIds
    thinker_hidden_size: int
    audio_token_id: int
    image_token_id: int
    video_token_id: int
    im_start_token_id: int
    im_end_token_id: int
    user_token_id: int
    assistant_token_id: int
    tts_pad_token_id: int
    tts_bos_token_id: int
    tts_eos_token_id: int

    @classmethod
    def from_folder(cls, folder: Path | str) -> Qwen3OmniConfig:
        raw = json.loads((Path(folder) / "config.json").read_text())
        if raw.get("model_type") != "qwen3_omni_moe":
            raise ValueError(f"{folder}: model_type {raw.get('model_type')!r}, not qwen3_omni_moe")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Qwen3OmniConfig:
        thinker = raw["thinker_config"]
        talker = raw["talker_config"]
        audio = thinker["audio_config"]
        wav = raw["code2wav_config"]
        wav_rope = dict(wav.get("rope_scaling") or {})
        wav_rope.update(wav.get("rope_parameters") or {})
        return cls(
            thinker=decoder_shape(thinker["text_config"]),
            audio=AudioEncoderShape(
                num_mel_bins=int(audio.get("num_mel_bins", 128)),
                d_model=int(audio["d_model"]),
                num_layers=int(audio["encoder_layers"]),
                num_heads=int(audio["encoder_attention_heads"]),
                ffn_dim=int(audio["encoder_ffn_dim"]),
                output_dim=int(audio["output_dim"]),
                downsample_hidden_size=int(audio.get("downsample_hidden_size", 480)),
                n_window=int(audio.get("n_window", 50)),
                n_window_infer=int(audio.get("n_window_infer", 800)),
                max_source_positions=int(audio.get("max_source_positions", 1500)),
            ),
            talker=decoder_shape(talker["text_config"]),
            code_predictor=decoder_shape(talker["code_predictor_config"], mrope=False),
            code2wav=Code2WavShape(
                codebook_size=int(wav["codebook_size"]),
                num_quantizers=int(wav["num_quantizers"]),
                hidden_size=int(wav["hidden_size"]),
                num_layers=int(wav["num_hidden_layers"]),
                num_heads=int(wav["num_attention_heads"]),
                num_kv_heads=int(wav.get("num_key_value_heads") or wav["num_attention_heads"]),
                intermediate_size=int(wav["intermediate_size"]),
                sliding_window=int(wav.get("sliding_window", 72)),
                rms_norm_eps=float(wav.get("rms_norm_eps", 1e-5)),
                rope_theta=float(wav_rope.get("rope_theta", wav.get("rope_theta", 10000.0))),
                upsample_rates=tuple(wav.get("upsample_rates", (8, 5, 4, 3))),
                upsampling_ratios=tuple(wav.get("upsampling_ratios", (2, 2))),
                decoder_dim=int(wav.get("decoder_dim", 1536)),
            ),
            talker_ids=TalkerIds(
                num_code_groups=int(talker.get("num_code_groups", 32)),
                accept_hidden_layer=int(talker.get("accept_hidden_layer", 18)),
                codec_pad=int(talker["codec_pad_id"]),
                codec_bos=int(talker["codec_bos_id"]),
                codec_eos=int(talker["codec_eos_token_id"]),
                codec_nothink=int(talker["codec_nothink_id"]),
                codec_think_bos=int(talker["codec_think_bos_id"]),
                codec_think_eos=int(talker["codec_think_eos_id"]),
                speakers={k.lower(): int(v) for k, v in (talker.get("speaker_id") or {}).items()},
            ),
            thinker_hidden_size=int(talker.get("thinker_hidden_size", 2048)),
            audio_token_id=int(thinker.get("audio_token_id", 151646)),
            image_token_id=int(thinker.get("image_token_id", 151655)),
            video_token_id=int(thinker.get("video_token_id", 151656)),
            im_start_token_id=int(raw.get("im_start_token_id", 151644)),
            im_end_token_id=int(raw.get("im_end_token_id", 151645)),
            user_token_id=int(raw.get("user_token_id", 872)),
            assistant_token_id=int(raw.get("assistant_token_id", 77091)),
            tts_pad_token_id=int(raw.get("tts_pad_token_id", 151671)),
            tts_bos_token_id=int(raw.get("tts_bos_token_id", 151672)),
            tts_eos_token_id=int(raw.get("tts_eos_token_id", 151673)),
        )
