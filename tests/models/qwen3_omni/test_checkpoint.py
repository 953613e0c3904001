"""The random Qwen3-Omni checkpoint (`omni-bench random-checkpoint qwen3-omni`) is in the
published layout, and our modules read exactly its tensors: tiny (written) and full size
(names and shapes only, from transformers' model on the meta device, no weights written)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_server.models.qwen3_omni.audio_encoder import AudioEncoder
from omni_server.models.qwen3_omni.code2wav import Code2Wav
from omni_server.models.qwen3_omni.config import Qwen3OmniConfig
from omni_server.models.qwen3_omni.layers import stack_experts
from omni_server.models.qwen3_omni.talker import Talker
from omni_server.models.qwen3_omni.thinker import Thinker
from omni_server.models.qwen3_omni.weights import CheckpointWeights
from tests.models.qwen3_omni.conftest import Checkpoint


def test_tiny_folder_is_in_the_published_layout(checkpoint: Checkpoint) -> None:
    files = {p.name for p in checkpoint.folder.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "preprocessor_config.json",
    } <= files
    config = json.loads((checkpoint.folder / "config.json").read_text())
    assert config["model_type"] == "qwen3_omni_moe"
    names = CheckpointWeights(checkpoint.folder).files
    # published names: per-expert matrices, the text model under thinker.model, the towers
    # under thinker (transformers renames them on load)
    assert "thinker.model.layers.0.mlp.experts.15.gate_proj.weight" in names
    assert "talker.model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert "thinker.audio_tower.conv2d1.weight" in names
    assert not [n for n in names if "language_model" in n or "gate_up_proj" in n]


def test_tiny_folder_loads_in_transformers_tokenizer_and_features(checkpoint: Checkpoint) -> None:
    from transformers import WhisperFeatureExtractor

    tokenizer = checkpoint.tokenizer
    config = Qwen3OmniConfig.from_folder(checkpoint.folder)
    assert tokenizer.audio_token_id == config.audio_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == config.im_start_token_id
    assert tokenizer.convert_tokens_to_ids("<tts_pad>") == config.tts_pad_token_id
    assert tokenizer.encode("user") == [config.user_token_id]
    features = WhisperFeatureExtractor.from_pretrained(checkpoint.folder)
    assert (features.feature_size, features.sampling_rate, features.hop_length) == (128, 16000, 160)


def _published_shapes() -> tuple[dict[str, tuple[int, ...]], Any]:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from omni_bench.random_qwen3_omni import build_config, published_names

    config = build_config("full", {"system": 8948, "user": 872, "assistant": 77091})
    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(config)
    return {k: tuple(v.shape) for k, v in published_names(model.state_dict().items())}, config


def test_full_size_names_and_shapes_are_what_our_modules_read() -> None:
    shapes, hf_config = _published_shapes()
    config = Qwen3OmniConfig.from_dict(hf_config.to_dict())
    assert (config.thinker.num_layers, config.thinker.num_experts, config.thinker.top_k) == (
        48,
        128,
        8,
    )
    with torch.device("meta"):
        parts = {
            "thinker.": Thinker(config.thinker),
            "thinker.audio_tower.": AudioEncoder(config.audio),
            "talker.": Talker(config),
            "code2wav.": Code2Wav(config.code2wav),
        }
    for prefix, module in parts.items():
        theirs = {
            k[len(prefix) :]: torch.empty(v, device="meta")
            for k, v in shapes.items()
            if k.startswith(prefix)
            and not (
                prefix == "thinker." and k.startswith(("thinker.audio_tower.", "thinker.visual."))
            )
        }
        theirs = {k: tuple(v.shape) for k, v in stack_experts(theirs).items()}
        ours = {k: tuple(v.shape) for k, v in module.named_parameters()}
        renamed = {_published(prefix, k): v for k, v in ours.items()}
        assert renamed == theirs, prefix


def _published(prefix: str, name: str) -> str:
    """Our parameter name -> the published one below `prefix` (the few places they differ)."""
    if prefix == "thinker.":
        if name.startswith("model."):
            return name
        return {"embed_tokens.weight": "model.embed_tokens.weight"}.get(name, name)
    if prefix == "talker.":
        if name == "codec_embedding.weight":
            return "model.codec_embedding.weight"
        return name.replace(
            "code_predictor.codec_embedding.", "code_predictor.model.codec_embedding."
        )
    return name


def test_sharded_writes_read_the_same(
    checkpoint: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the shard size the writer streams shards + an index (as the full size does at
    4 GiB); the tensors read back are the unsharded write's, for transformers and for us."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    import omni_bench.random_checkpoint as writer
    from omni_bench.random_qwen3_omni import write_qwen3_omni

    monkeypatch.setattr(writer, "SHARD_BYTES", 1 << 20)
    folder = write_qwen3_omni(tmp_path / "sharded", "tiny", seed=checkpoint.seed)
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 2
    ours = CheckpointWeights(folder).prefixed("")
    single = CheckpointWeights(checkpoint.folder).prefixed("")
    assert ours.keys() == single.keys()
    assert all(torch.equal(ours[k], single[k]) for k in ours)
    loaded = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder).state_dict()
    reference = checkpoint.reference.state_dict()
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)
