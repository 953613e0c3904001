"""Our thinker (models/qwen3_omni/thinker.py) against transformers' on tiny random checkpoints:
prompt logits within fp32 tolerance, and greedy text (64 tokens, EOS suppressed on both sides)
identical to `generate(..., return_audio=False)` for text prompts."""

from __future__ import annotations

import pytest
import torch

from omni_server.models.qwen3_omni.thinker import Thinker, greedy_generate, prompt_positions
from tests.models.qwen3_omni.conftest import Checkpoint

NEW_TOKENS = 64
PROMPTS = [
    "Hello, how are you today?",
    "The sun rises in the east and sets in the west. What is in this audio clip?",
]


@pytest.fixture(scope="module")
def thinker(checkpoint: Checkpoint) -> Thinker:
    return Thinker.from_checkpoint(checkpoint.folder)[0]


def chat_ids(checkpoint: Checkpoint, text: str) -> torch.Tensor:
    messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    return checkpoint.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]


def stop_ids(checkpoint: Checkpoint) -> list[int]:
    eos = checkpoint.reference.generation_config.eos_token_id
    return list(eos) if isinstance(eos, list) else [eos]


@pytest.mark.parametrize("text", PROMPTS)
def test_prompt_logits_match_transformers(
    checkpoint: Checkpoint, thinker: Thinker, text: str
) -> None:
    ids = chat_ids(checkpoint, text)
    with torch.no_grad():
        ours, _, _ = thinker(thinker.embed(ids), prompt_positions(0, ids.shape[1]))
        theirs = checkpoint.reference.thinker(
            input_ids=ids, attention_mask=torch.ones_like(ids)
        ).logits
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert theirs.std() > 0.1  # random weights that move the logits: the check compares something


@pytest.mark.parametrize("text", PROMPTS)
def test_greedy_text_equals_generate(checkpoint: Checkpoint, thinker: Thinker, text: str) -> None:
    ids = chat_ids(checkpoint, text)
    eos = stop_ids(checkpoint)
    with torch.no_grad():
        theirs = checkpoint.reference.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            return_audio=False,
            thinker_max_new_tokens=NEW_TOKENS,
            thinker_do_sample=False,
            thinker_suppress_tokens=eos,
        )
    expected = theirs[0, ids.shape[1] :].tolist()
    ours = greedy_generate(thinker, thinker.embed(ids), NEW_TOKENS, suppress_ids=tuple(eos))
    assert len(expected) == NEW_TOKENS
    assert ours == expected
    assert len(set(ours)) > 8  # not one token repeated: the context steers the output


def test_multimodal_rotary_matches_transformers_for_3d_positions(checkpoint: Checkpoint) -> None:
    """The interleaved sections with temporal, height and width positions that differ (as
    image and video tokens will have them): cos / sin equal the reference's rotary."""
    from omni_server.models.qwen3_omni.layers import rotary_cos_sin

    rotary = checkpoint.reference.thinker.model.language_model.rotary_emb
    positions = torch.stack([torch.arange(20) * 3, torch.arange(20) % 4, torch.arange(20) // 4])
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[:, None, :])
    config = Thinker.from_checkpoint(checkpoint.folder)[1].thinker
    ours_cos, ours_sin = rotary_cos_sin(positions, rotary.inv_freq, config.mrope_section)
    torch.testing.assert_close(ours_cos, cos[0])
    torch.testing.assert_close(ours_sin, sin[0])
    plain_cos, _ = rotary_cos_sin(positions[0], rotary.inv_freq, None)
    assert not torch.allclose(plain_cos, ours_cos)  # the height / width sections count
