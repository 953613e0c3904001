"""Our talker + code predictor (models/qwen3_omni/talker.py, talker_input.py) against
transformers' on tiny random checkpoints: for the same conversation, our thinker's greedy text
and the talker prompt built from it, greedy codes (every one of the G code groups) IDENTICAL to
the codes `generate(..., return_audio=True)` hands to code2wav, over 48 frames (codec EOS
suppressed on both sides; the reference's default repetition penalty 1.05 on both), for text
prompts and for a prompt carrying audio (its placeholders reach the talker through the thinker's
hidden states)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from omni_server.models.qwen3_omni.audio_encoder import AudioEncoder, output_lengths
from omni_server.models.qwen3_omni.mel import log_mel
from omni_server.models.qwen3_omni.talker import Talker
from omni_server.models.qwen3_omni.talker_input import (
    opening_prompt,
    project_text,
    speaker_id,
    talker_prompt,
)
from omni_server.models.qwen3_omni.thinker import Thinker, greedy_run
from tests.models.qwen3_omni.conftest import Checkpoint
from tests.models.qwen3_omni.test_audio import clip

pytestmark = pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning")

FRAMES = 48
THINKER_TOKENS = 12
PENALTY = 1.05  # the reference's default talker_repetition_penalty


@pytest.fixture(scope="module")
def models(checkpoint: Checkpoint):  # type: ignore[no-untyped-def]
    thinker, config = Thinker.from_checkpoint(checkpoint.folder)
    return config, thinker, Talker.from_checkpoint(checkpoint.folder)[0]


def reference_codes(
    checkpoint: Checkpoint,
    ids: torch.Tensor,
    eos: list[int],
    speaker: str = "Ethan",
    **audio: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(thinker sequences, the codes [G, frames] the reference decodes to audio)."""
    ref = checkpoint.reference
    vocab = ref.config.talker_config.text_config.vocab_size
    seen = []
    decode = ref.code2wav.chunked_decode

    def spy(codes, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(codes.clone())
        return decode(codes, *args, **kwargs)

    with mock.patch.object(ref.code2wav, "chunked_decode", side_effect=spy), torch.no_grad():
        sequences, _ = ref.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            return_audio=True,
            speaker=speaker,
            thinker_max_new_tokens=THINKER_TOKENS,
            thinker_do_sample=False,
            thinker_eos_token_id=eos,
            talker_do_sample=False,
            talker_max_new_tokens=FRAMES + 1,
            talker_repetition_penalty=PENALTY,
            talker_suppress_tokens=list(range(vocab - 1024, vocab)),  # EOS too: 48 frames
            **audio,
        )
    return sequences, seen[0][0]


@pytest.mark.parametrize("text", ["Hello, how are you today?", "What is in this audio clip?"])
def test_talker_codes_equal_the_reference(checkpoint: Checkpoint, models, text: str) -> None:  # type: ignore[no-untyped-def]
    config, thinker, talker = models
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": text}]},
    ]
    ids = checkpoint.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    eos = [config.im_end_token_id]
    sequences, expected = reference_codes(checkpoint, ids, eos)

    run = greedy_run(
        thinker,
        thinker.embed(ids),
        THINKER_TOKENS,
        stop_ids=tuple(eos),
        capture_layer=config.talker_ids.accept_hidden_layer,
    )
    assert run.tokens == sequences[0, ids.shape[1] :].tolist()
    heard = talker_prompt(
        config, thinker, talker, ids, run.tokens, run.embeds, run.captured, "Ethan"
    )
    state = talker.prefill(heard.prompt, heard.trailing_text, heard.tts_pad, FRAMES + 1)
    ours = talker.greedy_frames(state, FRAMES + 1, PENALTY, suppress_eos=True)

    assert expected.shape == (config.talker_ids.num_code_groups, FRAMES)
    assert torch.equal(ours, expected)
    assert len(set(ours[0].tolist())) > 4 and len(set(ours[-1].tolist())) > 4  # codes vary


def test_talker_codes_for_an_audio_prompt_equal_the_reference(
    checkpoint: Checkpoint, models
) -> None:  # type: ignore[no-untyped-def]
    config, thinker, talker = models
    tokenizer = checkpoint.tokenizer
    features = log_mel(clip(2.73, checkpoint.seed))
    count = int(output_lengths(torch.tensor(features.shape[1])))
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "audio", "audio": "clip.wav"},
                {"type": "text", "text": "What is this?"},
            ],
        }
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    text = text.replace(tokenizer.audio_token, tokenizer.audio_token * count)
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    eos = [config.im_end_token_id]
    mask = torch.ones(1, features.shape[1], dtype=torch.long)
    sequences, expected = reference_codes(
        checkpoint, ids, eos, "Aiden", input_features=features[None], feature_attention_mask=mask
    )

    tower = AudioEncoder.from_checkpoint(checkpoint.folder)
    embeds = thinker.embed(ids, config.audio_token_id, tower(features, [features.shape[1]]))
    run = greedy_run(
        thinker,
        embeds,
        THINKER_TOKENS,
        stop_ids=tuple(eos),
        capture_layer=config.talker_ids.accept_hidden_layer,
    )
    assert run.tokens == sequences[0, ids.shape[1] :].tolist()
    heard = talker_prompt(
        config, thinker, talker, ids, run.tokens, run.embeds, run.captured, "Aiden"
    )
    state = talker.prefill(heard.prompt, heard.trailing_text, heard.tts_pad, FRAMES + 1)
    ours = talker.greedy_frames(state, FRAMES + 1, PENALTY, suppress_eos=True)
    assert torch.equal(ours, expected)
    # what the talker stage builds from the thinker's TalkerOpening: the same prompt
    rows = (ids[0] == config.audio_token_id).nonzero()[:, 0]
    assert run.captured is not None and len(rows) == count
    aiden = speaker_id(config, "Aiden")
    opening = opening_prompt(config, thinker.embed_tokens, talker, ids[0].tolist(),
                             run.captured[0, rows], run.tokens[0], aiden)  # fmt: skip
    assert torch.equal(opening, heard.prompt)


def test_streamed_thinker_text_gives_the_same_codes(checkpoint: Checkpoint, models) -> None:  # type: ignore[no-untyped-def]
    """The talker starts once the thinker's first token is in, and hears the rest token by
    token (then tts_eos) while it speaks: the frames equal the whole-text run's."""
    config, thinker, talker = models
    messages = [{"role": "user", "content": "Hello, how are you today?"}]
    ids = checkpoint.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    layer = config.talker_ids.accept_hidden_layer
    run = greedy_run(thinker, thinker.embed(ids), THINKER_TOKENS, capture_layer=layer)
    whole = talker_prompt(
        config, thinker, talker, ids, run.tokens, run.embeds, run.captured, "Ethan"
    )
    state = talker.prefill(whole.prompt, whole.trailing_text, whole.tts_pad, FRAMES + 1)
    expected = talker.greedy_frames(state, FRAMES + 1, PENALTY, suppress_eos=True)

    s = ids.shape[1]
    start = talker_prompt(config, thinker, talker, ids, run.tokens[:2], run.embeds[:, : s + 1],
                          run.captured[:, : s + 1], "Ethan", text_done=False)  # fmt: skip
    assert torch.equal(start.prompt, whole.prompt)
    state = talker.prefill(start.prompt, start.trailing_text, start.tts_pad, FRAMES + 1)
    pending = [project_text(thinker, talker, [t]) for t in run.tokens[1:-1]] + [start.tts_eos]
    frames = []
    for _ in range(FRAMES):
        if pending:  # one thinker token arrives per talker frame, ahead of its use
            state.hear(pending.pop(0))
        frames.append(talker.step_frame(state, talker.choose_code0(state, PENALTY, True)))
    assert torch.equal(torch.tensor(frames).T, expected)
