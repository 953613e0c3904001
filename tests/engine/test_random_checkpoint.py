"""`omni-bench random-checkpoint higgs-audio-v2 --size tiny`: a folder transformers' own classes
load (the model, and in a child process the processor with its audio tokenizer), and the engine
reads as the higgs_audio_v2 family.

The processor load runs in a child process because transformers will not build the audio
tokenizer without torchaudio, which has no working wheel for this torch here; the child sees the
writer's documented stand-in (`torchaudio_stand_in`, whose resample raises), or the real
torchaudio where one imports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omni_server.engine.checkpoint import open_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def higgs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_bench.random_checkpoint import main

    out = tmp_path_factory.mktemp("ckpt") / "higgs"
    assert main(["higgs-audio-v2", "--size", "tiny", "--out", str(out)]) == 0
    return out


def test_layout(higgs_dir: Path) -> None:
    names = {p.relative_to(higgs_dir).as_posix() for p in higgs_dir.rglob("*") if p.is_file()}
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "processor_config.json",
                 "audio_tokenizer/config.json", "audio_tokenizer/model.safetensors"):  # fmt: skip
        assert name in names
    size = sum(p.stat().st_size for p in higgs_dir.rglob("*") if p.is_file())
    assert size < 10e6, f"tiny is {size / 1e6:.1f} MB"
    config = json.loads((higgs_dir / "config.json").read_text())
    assert config["model_type"] == "higgs_audio_v2" and config["num_codebooks"] == 8
    processor = json.loads((higgs_dir / "processor_config.json").read_text())
    assert processor["audio_tokenizer"]["audio_tokenizer_name_or_path"] == str(
        higgs_dir / "audio_tokenizer"
    )


def test_transformers_loads_the_model(higgs_dir: Path) -> None:
    model = transformers.HiggsAudioV2ForConditionalGeneration.from_pretrained(higgs_dir)
    config = model.config
    assert config.codebook_size == 130 and config.audio_stream_eos_id == 129
    tokenizer = transformers.AutoTokenizer.from_pretrained(higgs_dir)
    for token, field in [("<|AUDIO_OUT|>", "audio_token_id"),
                         ("<|audio_out_bos|>", "audio_bos_token_id"),
                         ("<|reserved_special_token_6|>", "audio_delay_token_id"),
                         ("<|eot_id|>", "eos_token_id")]:  # fmt: skip
        assert tokenizer.convert_tokens_to_ids(token) == getattr(config, field), token
    # every weight came from the file: the random norms are 1, the matrices not HF's 0.02 init
    assert torch.all(model.model.norm.weight == 1)
    assert model.audio_lm_head.weight.std().item() > 0.1


def test_engine_reads_it_as_higgs(higgs_dir: Path) -> None:
    checkpoint = open_checkpoint(higgs_dir)
    assert checkpoint.family.name == "higgs_audio_v2"
    audio = checkpoint.spec.audio
    assert audio is not None
    assert (audio.num_codebooks, audio.codebook_size, audio.stream_eos_id) == (8, 130, 129)
    assert checkpoint.spec.shape.rope_scaling is not None


def turn(role: str, text: str) -> dict[str, object]:
    return {"role": role, "content": [{"type": "text", "text": text}]}


# A TTS request as the reference documents it: system message, scene, the text to speak.
TTS_CONVERSATION = [
    turn("system", "Generate audio following instruction."),
    turn("scene", "Audio is recorded from a quiet room."),
    turn("user", "The sun rises in the east."),
]

PROCESSOR_CHECK = """
import json, sys, torch
from transformers import AutoTokenizer, HiggsAudioV2Processor
folder = sys.argv[1]
processor = HiggsAudioV2Processor.from_pretrained(folder)
assert processor.audio_tokenizer.config.num_quantizers == 8
assert processor.audio_stream_eos_id == 129
conversation = json.loads(sys.argv[2])
inputs = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                       return_dict=True, sampling_rate=24000, return_tensors="pt")
ids = inputs["input_ids"][0].tolist()
text = AutoTokenizer.from_pretrained(folder).decode(ids)
assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>"), text
assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\\n\\n<|audio_out_bos|>"), text
assert "<|scene_desc_start|>\\nAudio is recorded from a quiet room.\\n<|scene_desc_end|>" in text
# decoding codes to a waveform runs (the stand-in is never called on this path)
codes = torch.randint(0, 128, (1, 8, 10))
audio = processor.audio_tokenizer.decode(codes).audio_values
assert audio.shape[-1] == 10 * 960, audio.shape
print(" ".join(map(str, ids)))
"""


def test_transformers_loads_the_processor(higgs_dir: Path, tmp_path: Path) -> None:
    from omni_bench.random_checkpoint import has_torchaudio, torchaudio_stand_in

    paths = sys.path if has_torchaudio() else [str(torchaudio_stand_in(tmp_path)), *sys.path]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    run = subprocess.run(
        [sys.executable, "-c", PROCESSOR_CHECK, str(higgs_dir), json.dumps(TTS_CONVERSATION)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    processor_ids = [int(t) for t in run.stdout.split()]
    from omni_server.engine.hf_tokenizer import HFTokenizer

    assert HFTokenizer(higgs_dir).encode_chat(TTS_CONVERSATION) == processor_ids


def test_full_size_names_and_shapes_match_transformers() -> None:
    """The full size's config (Llama-3.2-3B backbone, 8 x 1026 codes) as transformers builds it
    on the meta device (nothing allocated): every tensor it would save is one the family
    expects, with the same shape, and the other way round."""
    from omni_bench.random_checkpoint import backbone_shape, special_token_ids
    from omni_server.engine.families import FAMILIES

    shape = backbone_shape("full")
    config = transformers.HiggsAudioV2Config(
        **shape, codebook_size=1026, **special_token_ids(shape["vocab_size"])
    )
    with torch.device("meta"):
        model = transformers.HiggsAudioV2ForConditionalGeneration(config)
    theirs = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    family = FAMILIES["higgs_audio_v2"]
    spec = family.read(config.to_dict(), Path("full"))
    assert spec.shape.num_params > 3e9
    assert family.expected_weights(spec) == theirs


def test_audio_eos_scale_scales_only_the_end_rows(higgs_dir: Path, tmp_path: Path) -> None:
    """`--audio-eos-scale` (through `redraw_higgs_audio_v2`, which the writer's weights share):
    the same seed's weights, the audio head's stream-EOS row of each codebook times the scale,
    every other value unchanged; another seed, other values."""
    import shutil

    from safetensors.torch import load_file

    from omni_bench.random_checkpoint import redraw_higgs_audio_v2

    plain = load_file(higgs_dir / "model.safetensors")
    folder = tmp_path / "higgs"
    shutil.copytree(higgs_dir, folder)
    scaled = load_file(redraw_higgs_audio_v2(folder, 0, 0.5) / "model.safetensors")
    head, head_scaled = plain["audio_lm_head.weight"], scaled["audio_lm_head.weight"]
    end = torch.zeros(head.shape[0], dtype=torch.bool)
    end[129::130] = True  # [8 * 130, hidden]: codebook k's EOS at row k * 130 + 129
    assert torch.equal(head_scaled[end], head[end] * 0.5)
    assert torch.equal(head_scaled[~end], head[~end])
    assert all(torch.equal(plain[name], scaled[name]) for name in plain if "lm_head" not in name)
    other = load_file(redraw_higgs_audio_v2(folder, 1) / "model.safetensors")
    assert not torch.equal(other["audio_lm_head.weight"], head)
