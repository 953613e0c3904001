"""Audio in: our log-mel features (models/qwen3_omni/mel.py) against the checkpoint's
`WhisperFeatureExtractor`; our audio tower against transformers' (clips of several chunks, a
padded tail chunk, more than one attention window, two clips in one call); and greedy text for
a prompt carrying audio, through our tower and thinker, identical to
`generate(input_features=..., return_audio=False)` (64 tokens, EOS suppressed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_server.models.qwen3_omni.audio_encoder import AudioEncoder, output_lengths
from omni_server.models.qwen3_omni.mel import frames_for, log_mel
from omni_server.models.qwen3_omni.thinker import Thinker, greedy_generate
from tests.models.qwen3_omni.conftest import Checkpoint

NEW_TOKENS = 64


def clip(seconds: float, seed: int) -> np.ndarray:
    """16 kHz: two tones gliding plus noise (varied mel frames, not silence)."""
    t = np.arange(int(seconds * 16000)) / 16000
    rng = np.random.default_rng(seed)
    wave = 0.3 * np.sin(2 * np.pi * (220 + 300 * t) * t) + 0.1 * np.sin(2 * np.pi * 1800 * t)
    return (wave + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


@pytest.fixture(scope="module")
def tower(checkpoint: Checkpoint) -> AudioEncoder:
    return AudioEncoder.from_checkpoint(checkpoint.folder)


@pytest.fixture(scope="module")
def feature_extractor(checkpoint: Checkpoint):  # type: ignore[no-untyped-def]
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor.from_pretrained(checkpoint.folder)


@pytest.mark.parametrize("seconds", [0.5, 2.73, 4.0])
def test_log_mel_matches_the_feature_extractor(feature_extractor, seconds: float) -> None:  # type: ignore[no-untyped-def]
    audio = clip(seconds, 3)
    theirs = feature_extractor(
        audio,
        sampling_rate=16000,
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    ours = log_mel(audio)
    assert ours.shape[1] == frames_for(len(audio)) == int(theirs["attention_mask"].sum())
    torch.testing.assert_close(ours, theirs["input_features"][0], atol=2e-5, rtol=1e-5)


def test_tower_matches_transformers(checkpoint: Checkpoint, tower: AudioEncoder) -> None:
    clips = [log_mel(clip(2.73, 1)), log_mel(clip(1.2, 2))]  # 273 frames: 100 + 100 + 73
    lengths = [c.shape[1] for c in clips]
    features = torch.cat(clips, dim=1)
    with torch.no_grad():
        ours = tower(features, lengths)
        theirs = checkpoint.reference.thinker.model.audio_tower(
            features, feature_lens=torch.tensor(lengths)
        ).last_hidden_state
    assert ours.shape[0] == int(output_lengths(torch.tensor(lengths)).sum())
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    assert theirs.std() > 0.1


def test_greedy_text_for_an_audio_prompt_equals_generate(
    checkpoint: Checkpoint, tower: AudioEncoder
) -> None:
    tokenizer = checkpoint.tokenizer
    audio = clip(2.73, checkpoint.seed)
    features = log_mel(audio)
    count = int(output_lengths(torch.tensor(features.shape[1])))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "audio", "audio": "clip.wav"},
                {"type": "text", "text": "What is in this audio clip?"},
            ],
        }
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # the processor's expansion: one placeholder per embedding the tower gives
    text = text.replace(tokenizer.audio_token, tokenizer.audio_token * count)
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    eos = checkpoint.reference.generation_config.eos_token_id
    with torch.no_grad():
        theirs = checkpoint.reference.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            return_audio=False,
            input_features=features[None],
            feature_attention_mask=torch.ones(1, features.shape[1], dtype=torch.long),
            thinker_max_new_tokens=NEW_TOKENS,
            thinker_do_sample=False,
            thinker_suppress_tokens=eos,
        )
        thinker = Thinker.from_checkpoint(checkpoint.folder)[0]
        audio_token = tokenizer.audio_token_id
        embeds = thinker.embed(ids, audio_token, tower(features, [features.shape[1]]))
        ours = greedy_generate(thinker, embeds, NEW_TOKENS, suppress_ids=tuple(eos))
    assert ours == theirs[0, ids.shape[1] :].tolist()
    # the audio matters: the same prompt with the audio's embeddings zeroed answers otherwise
    silent = thinker.embed(ids, audio_token, torch.zeros(count, thinker.shape.hidden_size))
    assert greedy_generate(thinker, silent, NEW_TOKENS, suppress_ids=tuple(eos)) != ours
