"""Our Llama against transformers' LlamaForCausalLM on the same GGUF.

Tolerance: max |logit difference| <= 1e-3 in float32 (logits reach ~40; measured ~7e-5). The two
differ only in float summation order (fused QKV, adjacent-pair RoPE on the file's row order vs
transformers' un-permuted halves), so anything larger is a real bug.
"""

from __future__ import annotations

import torch

from omni_server.engine.attention import ForwardBatch, PrefillChunk
from omni_server.engine.families.llama.gguf import GGUFModel, smollm2_gguf_path
from omni_server.engine.families.llama.model import Llama
from omni_server.engine.kv_cache import KVCache
from omni_server.engine.tokenizer import GGUFTokenizer
from tests.engine.conftest import CHAT_PROMPTS

LOGIT_TOLERANCE = 1e-3


def test_metadata_read(gguf: GGUFModel) -> None:
    shape = gguf.shape
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads) == (
        30,
        576,
        9,
        3,
    )
    assert shape.rope_theta == 100000.0 and shape.tie_word_embeddings
    assert abs(shape.rms_norm_eps - 1e-5) < 1e-9
    assert smollm2_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def _prefill_logits(model: Llama, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Logits of every position, prefilling `ids` in chunks of the given sizes through the cache."""
    cache = KVCache(model.shape, 1024, 16, torch.float32, torch.device("cpu"))
    table: list[int] = []
    cache.allocator.allocate(table, len(ids))
    slots = cache.slot_matrix([table], len(ids))[0]
    out = []
    start = 0
    for n in chunks:
        end = start + n
        batch = ForwardBatch(
            input_ids=torch.tensor(ids[start:end]),
            positions=torch.arange(start, end),
            slot_mapping=slots[start:end],
            logits_indices=torch.arange(n),
            decode=None,
            prefills=[PrefillChunk(0, n, slots[:end])],
        )
        with torch.inference_mode():
            out.append(model(batch, cache.k, cache.v))
        start = end
    return torch.cat(out)


def test_logits_equal_transformers(smol_model: Llama, tokenizer: GGUFTokenizer, hf_model) -> None:
    ids = tokenizer.encode_chat(CHAT_PROMPTS[1])
    ours = _prefill_logits(smol_model, ids, [len(ids)])
    with torch.inference_mode():
        theirs = hf_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == theirs.shape
    diff = (ours - theirs).abs().max().item()
    assert diff <= LOGIT_TOLERANCE, f"max |logit diff| {diff}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_chunked_prefill_equals_one_shot(smol_model: Llama, tokenizer: GGUFTokenizer) -> None:
    ids = tokenizer.encode_chat(CHAT_PROMPTS[0])
    one_shot = _prefill_logits(smol_model, ids, [len(ids)])
    chunked = _prefill_logits(smol_model, ids, [7, 16, len(ids) - 23])  # uneven, across blocks
    assert (one_shot - chunked).abs().max().item() <= LOGIT_TOLERANCE
