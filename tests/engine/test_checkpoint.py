"""Hugging Face checkpoint folders (engine/checkpoint.py, engine/families): a tiny random Llama
written by `omni-bench random-checkpoint llama` loads into the engine and answers as transformers'
LlamaForCausalLM on the same folder does; a broken folder is refused in one line naming it.

Tolerance as tests/engine/test_llama.py: max |logit difference| <= 1e-3 in float32. The two differ
in summation order only (fused QKV, adjacent-pair RoPE on reordered rows vs rotate-half), so more
is a bug. The tiny config uses llama3 RoPE scaling with a short original context, so the scaled
frequencies are exercised.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from omni_server.engine import (
    CheckpointError,
    Engine,
    EngineConfig,
    GenerationRequest,
    SamplingParams,
)
from tests.engine.test_llama import LOGIT_TOLERANCE, _prefill_logits

transformers = pytest.importorskip("transformers")

MESSAGES = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, how are you?"},
    ],
    [{"role": "user", "content": "The sun rises in the east and sets in the west."}],
    [{"role": "user", "content": [{"type": "text", "text": "It was the night before 0123."}]}],
]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_bench.random_checkpoint import write_llama

    return write_llama(tmp_path_factory.mktemp("ckpt") / "llama", "tiny", seed=3)


@pytest.fixture(scope="module")
def engine(llama_dir: Path) -> Engine:
    return Engine.from_checkpoint(llama_dir, EngineConfig(max_total_tokens=2048, max_batch_size=4))


@pytest.fixture(scope="module")
def hf_llama(llama_dir: Path):  # type: ignore[no-untyped-def]
    return transformers.LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


def test_logits_equal_transformers(engine: Engine, hf_llama) -> None:
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode_chat(MESSAGES[0])
    ids = ids * 6  # 276 positions: past the config's original_max_position_embeddings (64)
    ours = _prefill_logits(engine.model, ids, [len(ids)])
    with torch.inference_mode():
        theirs = hf_llama(torch.tensor([ids])).logits[0].float()
    diff = (ours - theirs).abs().max().item()
    assert diff <= LOGIT_TOLERANCE, f"max |logit diff| {diff}"
    assert theirs.abs().max().item() > 1.0  # logits that could disagree
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_greedy_equals_transformers_generate(engine: Engine, llama_dir: Path, hf_llama) -> None:
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(llama_dir)
    assert engine.tokenizer is not None
    eos = hf_llama.generation_config.eos_token_id
    for i, messages in enumerate(MESSAGES):
        prompt = engine.tokenizer.encode_chat(messages)
        theirs_prompt = hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert prompt == list(theirs_prompt), f"prompt {i}"
        with torch.inference_mode():
            generated = hf_llama.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False
            )[0, len(prompt) :].tolist()
        expected = generated[: generated.index(eos)] if eos in generated else generated
        params = SamplingParams(temperature=0, max_tokens=24)
        events = engine.generate([GenerationRequest(f"r{i}", prompt, params)])[f"r{i}"]
        assert [t for e in events for t in e.token_ids] == expected, f"prompt {i}"
        text = hf_tokenizer.decode(expected, skip_special_tokens=True)
        assert "".join(e.text for e in events) == text
        assert len(set(expected)) > 3  # a random model that varies with its context


def test_tokenizer_equals_transformers(engine: Engine, llama_dir: Path) -> None:
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(llama_dir)
    assert engine.tokenizer is not None
    for text in ["Hello world", "  spaces\tand\nlines ", "digits 0123456789", "é, 中文, 🙂",
                 "<|eot_id|>inline<|start_header_id|>"]:  # fmt: skip
        assert engine.tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)
        ids = engine.tokenizer.encode(text)
        assert engine.tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path}: no config.json"):
        Engine.from_checkpoint(tmp_path)


def test_unknown_model_type_names_the_supported(llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(llama_dir, tmp_path / "m")
    _edit_config(folder, model_type="mamba")
    with pytest.raises(CheckpointError) as err:
        Engine.from_checkpoint(folder)
    message = str(err.value)
    assert str(folder) in message and "'mamba'" in message
    assert "higgs_audio_v2" in message and "llama" in message
    assert "\n" not in message


def test_weights_disagreeing_with_config(llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(llama_dir, tmp_path / "m")
    _edit_config(folder, intermediate_size=96)
    with pytest.raises(CheckpointError) as err:
        Engine.from_checkpoint(folder)
    message = str(err.value)
    assert str(folder) in message
    assert (
        "model.layers.0.mlp.down_proj.weight is [64, 128], config.json implies [64, 96]" in message
    )


def test_missing_and_unexpected_weights(llama_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = _copy(llama_dir, tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.extra.weight"] = tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        Engine.from_checkpoint(folder)
    message = str(err.value)
    assert "1 weight(s) missing for llama: model.layers.1.mlp.up_proj.weight" in message
    assert "1 unexpected weight(s) for llama: model.layers.0.extra.weight" in message


def test_unsupported_rope_type(llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy(llama_dir, tmp_path / "m")
    _edit_config(folder, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(CheckpointError, match="rope_type 'yarn' is not supported"):
        Engine.from_checkpoint(folder)


def test_a_load_opens_each_weights_file_once(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening a safetensors file parses its whole header (88 ms a tensor on a one-file
    checkpoint of 19k tensors, a full Qwen3-Omni thinker's count): the load opens each file
    once for all its tensors, not once a tensor (a 4.5-minute thinker start on the H200)."""
    import safetensors

    from omni_server.engine.checkpoint import open_checkpoint
    from omni_server.engine.loading import load_model

    checkpoint = open_checkpoint(llama_dir)  # the headers read here, before the count
    opened: list[str] = []
    real = safetensors.safe_open

    def counting(path: str, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        opened.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", counting)
    model = load_model(checkpoint, EngineConfig(max_total_tokens=256))
    assert model.shape.num_layers > 1 and len(checkpoint.files) > 10  # many tensors read
    assert sorted(opened) == sorted({str(f) for f in checkpoint.files.values()})  # one open a file
