"""Shared fixtures: the embedded SmolLM2 loaded once per session (ours and transformers'), and a
tiny random Llama for scheduler behaviour that does not depend on weights."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from omni_server.engine import Engine, EngineConfig, LlamaShape, load_gguf, smollm2_gguf_path
from omni_server.engine.families.llama.gguf import GGUFModel
from omni_server.engine.families.llama.model import Llama
from omni_server.engine.tokenizer import GGUFTokenizer

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ],
    [{"role": "user", "content": "Write one sentence about the sea."}],
]

TINY = LlamaShape(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    tie_word_embeddings=False,  # a tied random head just repeats the input token
)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():  # type: ignore[no-untyped-def]
    """One intra-op thread while these tests run (restored after each module).

    On the shared 2-core machine, two OpenMP threads wait on each other at every op's barrier
    while other processes hold the cores: measured 1-3 s a decode step, against ~0.15 s with one.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def gguf() -> GGUFModel:
    return load_gguf()


@pytest.fixture(scope="session")
def tokenizer(gguf: GGUFModel) -> GGUFTokenizer:
    return GGUFTokenizer(gguf.metadata)


@pytest.fixture(scope="session")
def smol_model(gguf: GGUFModel) -> Llama:
    model = Llama(gguf.shape, max_positions=2048)
    model.load_weights(gguf.weights)
    return model


@pytest.fixture(scope="session")
def make_engine(smol_model: Llama, tokenizer: GGUFTokenizer) -> Callable[..., Engine]:
    """A fresh engine (own KV cache and queues) around the one shared fp32 SmolLM2."""

    def make(**config: object) -> Engine:
        settings: dict[str, object] = {"max_total_tokens": 4096, "max_batch_size": 16}
        settings.update(config)
        return Engine(smol_model, EngineConfig.from_table(settings), tokenizer)

    return make


@pytest.fixture(scope="session")
def tiny_model() -> Llama:
    model = Llama(TINY, max_positions=TINY.max_position_embeddings)
    model.init_random(seed=1)
    return model


@pytest.fixture(scope="session")
def make_tiny_engine(tiny_model: Llama) -> Callable[..., Engine]:
    def make(**config: object) -> Engine:
        settings: dict[str, object] = {"max_total_tokens": 512, "max_batch_size": 8}
        settings.update(config)
        return Engine(tiny_model, EngineConfig.from_table(settings), None)

    return make


@pytest.fixture(scope="session")
def hf_tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_model():  # type: ignore[no-untyped-def]
    """transformers' LlamaForCausalLM from the same GGUF, dequantized to dense float32."""
    from transformers import GgufConfig, LlamaForCausalLM

    path = smollm2_gguf_path()
    model = LlamaForCausalLM.from_pretrained(
        path.parent,
        gguf_file=path.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
    )
    return model.eval()
