"""The qwen3_omni_talker family: a Qwen3-Omni checkpoint folder (config.json's `talker_config`,
read by models/qwen3_omni/config.py) -> the talker's module (model.py). Its tensors: the talker's
decoder (`talker.model.*`, the thinker's layout plus a shared expert a sparse layer), its codec
head, the code predictor, the two projections, and the thinker's `embed_tokens` (what the talker
hears the thinker's tokens through). The checkpoint's other tensors (the thinker, the audio
tower, code2wav) are present and not loaded.

Not in the model_type registry (the folder's model_type names the thinker's family): a stage
opens the talker by name, `open_talker(folder)`, and builds its engine around it
(`talker_engine`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omni_server.engine.checkpoint import Checkpoint
from omni_server.engine.config import EngineConfig, LlamaShape
from omni_server.engine.engine import Engine
from omni_server.engine.errors import CheckpointError
from omni_server.engine.families.base import Architecture, Family, FamilyModel, TensorSource
from omni_server.engine.families.qwen3_omni_moe.checkpoint import thinker_engine_weights
from omni_server.engine.families.qwen3_omni_talker.model import Qwen3OmniTalker
from omni_server.engine.loading import load_model
from omni_server.engine.parallel import TensorParallel
from omni_server.models.qwen3_omni.config import Qwen3OmniConfig

BODY = "talker.model."
HEAD = "talker.codec_head.weight"
TEXT_EMBED = "thinker.model.embed_tokens.weight"
SHARED = {  # the published name under mlp. -> the engine's (Qwen3OmniTalker.load_weights)
    "shared_expert_gate.weight": "shared_gate",
    "shared_expert.gate_proj.weight": "shared_w_gate",
    "shared_expert.up_proj.weight": "shared_w_up",
    "shared_expert.down_proj.weight": "shared_w_down",
}


@dataclass(frozen=True)
class TalkerArchitecture(Architecture):
    """The talker decoder's Llama shape, the whole model's config (the talker's experts, the
    code predictor, the codec ids), and every tensor of the folder with its shape."""

    config: Qwen3OmniConfig | None = None
    weights: Mapping[str, tuple[int, ...]] | None = None


def _talker(spec: Architecture) -> tuple[LlamaShape, Qwen3OmniConfig]:
    if not isinstance(spec, TalkerArchitecture) or spec.config is None:
        raise TypeError("the qwen3_omni_talker family builds from a TalkerArchitecture")
    return spec.shape, spec.config


class Qwen3OmniTalkerFamily(Family):
    name = "qwen3_omni_talker"
    model_types = ()  # opened by name (open_talker): config.json names the thinker's family

    def read(self, config: Mapping[str, Any], folder: Path) -> TalkerArchitecture:
        try:
            omni = Qwen3OmniConfig.from_dict(dict(config))
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(folder, f"talker_config: {err}") from err
        talker = config["talker_config"]["text_config"]
        if talker.get("hidden_act", "silu") != "silu" or talker.get("attention_bias"):
            raise CheckpointError(folder, "the talker runs silu without attention biases only")
        moe = omni.talker
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
            max_position_embeddings=int(talker.get("max_position_embeddings") or 32768),
            tie_word_embeddings=False,
        )
        weights, _ = tensor_headers(folder)
        for name in (HEAD, TEXT_EMBED, BODY + "codec_embedding.weight", BODY + "norm.weight"):
            if name not in weights:
                raise CheckpointError(folder, f"no tensor {name} (not a Qwen3-Omni checkpoint?)")
        return TalkerArchitecture(shape, omni, weights)

    def expected_weights(self, spec: Architecture) -> dict[str, tuple[int, ...]]:
        assert isinstance(spec, TalkerArchitecture) and spec.weights is not None
        return dict(spec.weights)  # what the load reads is checked present in read()

    def build(self, spec: Architecture, max_positions: int, tp: TensorParallel) -> FamilyModel:
        shape, config = _talker(spec)
        return Qwen3OmniTalker(shape, config, max_positions=max_positions, tp=tp)

    def load(self, model: FamilyModel, tensors: TensorSource, spec: Architecture) -> None:
        shape, config = _talker(spec)
        moe = config.talker
        weights = thinker_engine_weights(tensors, shape, moe, BODY, HEAD, "codec_embedding.weight")

        def read(name: str) -> Callable[[], torch.Tensor]:
            return lambda: tensors(name).float()

        for i in range(shape.num_layers):
            if moe.is_moe(i) and moe.shared_expert_size:
                for theirs, ours in SHARED.items():
                    name = f"{BODY}layers.{i}.mlp.{theirs}"
                    weights.add(f"layers.{i}.{ours}", read(name))
        for name, _ in model.named_parameters():
            if name.startswith(("text_projection.", "hidden_projection.")):
                weights.add(name, read("talker." + name))
            elif name.startswith("code_predictor."):
                # the checkpoint keeps the predictor's embeddings under its model
                theirs = name.replace("code_predictor.codec_embedding.",
                                      "code_predictor.model.codec_embedding.")  # fmt: skip
                weights.add(name, read("talker." + theirs))
        weights.add("text_embed.weight", read(TEXT_EMBED))
        model.load_weights(weights)


def open_talker(folder: Path | str) -> Checkpoint:
    """A Qwen3-Omni checkpoint folder as the talker's model source (CheckpointError naming the
    folder when it is none); nothing is placed."""
    import json

    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(folder, "no config.json (a Hugging Face checkpoint folder has one)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(folder, f"config.json: {err}") from err
    family = Qwen3OmniTalkerFamily()
    spec = family.read(config, folder)
    _, files = tensor_headers(folder)
    return Checkpoint(folder, config, family, spec, files)


def tensor_headers(folder: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, Path]]:
    """Every tensor of the folder's safetensors files: its shape, and the file holding it."""
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    files: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open has keys(), no __iter__)
                    shapes[name] = tuple(f.get_slice(name).get_shape())
                    files[name] = path
        except (SafetensorError, OSError) as err:
            raise CheckpointError(folder, f"{path.name} is not a safetensors file ({err})") from err
    return shapes, files


def talker_engine(folder: Path | str, config: EngineConfig) -> Engine:
    """The talker's engine over a Qwen3-Omni checkpoint folder (token ids only: no tokenizer)."""
    return Engine(load_model(open_talker(folder), config), config, None)
