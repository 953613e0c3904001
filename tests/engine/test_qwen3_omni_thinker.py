"""Qwen3-Omni's thinker on the engine (families/qwen3_omni_moe) against transformers'
`Qwen3OmniMoeForConditionalGeneration.generate(..., return_audio=False)`, on tiny random
checkpoints (`omni-bench random-checkpoint qwen3-omni --size tiny`, the thinker's norm weights
redrawn around 1) for the seeds in SEEDS.

Compared, on every seed: greedy text IDENTICAL to the reference for two chat prompts of
different lengths, each alone and both in one batch (and with chunked prefill), MAX_TOKENS
(64) tokens each. The reference's thinker generates with no EOS of its own (its
generation_config has none: `generate` returns MAX_TOKENS tokens, the checkpoint's EOS ids
among them), so the engine runs with `ignore_eos`; with its EOS stop on, its text is the
reference's up to the first EOS. Then seeded sampling reproducible and independent of the
batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_server.engine import Engine, EngineConfig, GenerationRequest, SamplingParams

transformers = pytest.importorskip("transformers")

SEEDS = (0, 1)
MAX_TOKENS = 64
PROMPTS = {
    "short": "Hello, how are you today?",
    "long": "The sun rises in the east and sets in the west. Tell me, in a few words, why the "
    "sky looks blue at noon and red in the evening.",
}


@dataclass
class Seeded:
    folder: Path
    engine: Engine
    prompts: dict[str, list[int]]
    expected: dict[str, list[int]]  # transformers' greedy continuation of each prompt


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _chat_ids(tokenizer: Any, text: str) -> list[int]:
    messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    return [int(i) for i in ids[0]]


def _perturb_norms(folder: Path, seed: int) -> None:
    """The random checkpoint's norm weights are all ones, under which the order of a
    QK-norm's weights (the engine loads them in RoPE pair order) could not matter: draw the
    thinker's norm weights around 1 instead, for the reference and the engine alike."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    for name, value in tensors.items():
        if name.startswith("thinker.model.") and name.endswith("norm.weight"):
            tensors[name] = 1 + 0.5 * torch.randn(value.shape, generator=gen)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=SEEDS, ids=lambda seed: f"seed{seed}")
def seeded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Seeded:
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    from omni_bench.random_qwen3_omni import write_qwen3_omni

    folder: Path = write_qwen3_omni(
        tmp_path_factory.mktemp("qwen3omni") / "ckpt", "tiny", seed=request.param
    )
    _perturb_norms(folder, request.param)
    reference = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = {name: _chat_ids(tokenizer, text) for name, text in PROMPTS.items()}
    expected = {}
    for name, ids in prompts.items():
        tensor = torch.tensor([ids])
        with torch.no_grad():
            out = reference.generate(
                input_ids=tensor,
                attention_mask=torch.ones_like(tensor),
                return_audio=False,
                thinker_max_new_tokens=MAX_TOKENS,
                thinker_do_sample=False,
            )
        expected[name] = out[0, len(ids) :].tolist()
    engine = Engine.from_checkpoint(folder, EngineConfig(max_total_tokens=2048))
    return Seeded(folder, engine, prompts, expected)


def _run(
    engine: Engine, prompts: dict[str, list[int]], params: SamplingParams
) -> dict[str, list[int]]:
    requests = [GenerationRequest(name, ids, params) for name, ids in prompts.items()]
    events = engine.generate(requests)
    return {name: [t for e in events[name] for t in e.token_ids] for name in prompts}


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_prompts_differ_in_length_and_reference_runs_long(seeded: Seeded) -> None:
    lengths = {len(ids) for ids in seeded.prompts.values()}
    assert len(lengths) == 2
    for tokens in seeded.expected.values():
        assert len(tokens) == MAX_TOKENS
        assert len(set(tokens)) > 8  # the context steers the output: not one token repeated


def test_greedy_alone_equals_transformers_generate(seeded: Seeded) -> None:
    for name, ids in seeded.prompts.items():
        ours = _run(seeded.engine, {name: ids}, GREEDY)[name]
        assert ours == seeded.expected[name], name


def test_greedy_stops_at_the_first_eos(seeded: Seeded) -> None:
    tokenizer = seeded.engine.tokenizer
    assert tokenizer is not None
    eos = tokenizer.eos_token_ids  # generation_config.json's eos_token_id
    assert eos
    stopping = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for name, ids in seeded.prompts.items():
        expected = seeded.expected[name]
        end = next((i for i, t in enumerate(expected) if t in eos), len(expected))
        assert _run(seeded.engine, {name: ids}, stopping)[name] == expected[:end], name


def test_greedy_batched_equals_transformers_generate(seeded: Seeded) -> None:
    assert _run(seeded.engine, seeded.prompts, GREEDY) == seeded.expected


def test_greedy_with_chunked_prefill_equals_transformers_generate(seeded: Seeded) -> None:
    base = seeded.engine
    config = EngineConfig(max_total_tokens=2048, max_batch_size=4, max_step_tokens=8)
    chunked = Engine(base.model, config, base.tokenizer)
    assert min(len(ids) for ids in seeded.prompts.values()) > 8  # every prompt is chunked
    assert _run(chunked, seeded.prompts, GREEDY) == seeded.expected


def test_seeded_sampling_reproducible_and_batch_independent(seeded: Seeded) -> None:
    sampled = SamplingParams(
        temperature=1.0, top_k=50, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True
    )
    name, ids = "long", seeded.prompts["long"]
    alone = _run(seeded.engine, {name: ids}, sampled)[name]
    again = _run(seeded.engine, {name: ids}, sampled)[name]
    batched = _run(seeded.engine, seeded.prompts, sampled)[name]
    assert alone == again == batched
    assert alone != seeded.expected[name][: len(alone)]  # sampled, not the greedy path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_on_gpu_equals_transformers_with_and_without_cuda_graphs(seeded: Seeded) -> None:
    """float32 on CUDA (the fused Triton experts where triton is installed): the reference's
    greedy text, eager and with decode steps replayed from captured graphs."""
    for cuda_graphs in (False, True):
        config = EngineConfig(
            max_total_tokens=2048, device="cuda", dtype="float32", cuda_graphs=cuda_graphs
        )
        engine = Engine.from_checkpoint(seeded.folder, config)
        assert _run(engine, seeded.prompts, GREEDY) == seeded.expected, cuda_graphs
