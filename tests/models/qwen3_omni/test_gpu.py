"""Our Qwen3-Omni modules on a CUDA GPU (skipped without one) give what they give on the CPU:
the thinker's greedy text and the talker's codes identical in fp32, code2wav's waveform at
>= 40 dB SNR; and bf16 runs end to end (finite logits, audio in range)."""

from __future__ import annotations

import pytest
import torch

from omni_server.models.qwen3_omni.code2wav import Code2Wav
from omni_server.models.qwen3_omni.talker import Talker
from omni_server.models.qwen3_omni.talker_input import talker_prompt
from omni_server.models.qwen3_omni.thinker import Thinker, greedy_run
from tests.models.qwen3_omni.conftest import Checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def speak(folder, device: str, dtype: torch.dtype, ids: torch.Tensor):  # type: ignore[no-untyped-def]
    """Greedy text, 48 frames of codes and their audio, all on `device` in `dtype`."""
    thinker, config = Thinker.from_checkpoint(folder, dtype)
    talker = Talker.from_checkpoint(folder, dtype)[0].to(device)
    code2wav = Code2Wav.from_checkpoint(folder, dtype).to(device)
    thinker = thinker.to(device)
    ids = ids.to(device)
    run = greedy_run(thinker, thinker.embed(ids), 12, stop_ids=(config.im_end_token_id,),
                     capture_layer=config.talker_ids.accept_hidden_layer)  # fmt: skip
    heard = talker_prompt(
        config, thinker, talker, ids, run.tokens, run.embeds, run.captured, "Ethan"
    )
    state = talker.prefill(heard.prompt, heard.trailing_text, heard.tts_pad, 49)
    frames = talker.greedy_frames(state, 49, 1.05, suppress_eos=True)
    audio = code2wav(frames[None].to(device))
    return run.tokens, frames, audio.float().cpu()


def test_cuda_equals_cpu_in_fp32_and_bf16_runs(checkpoint: Checkpoint) -> None:
    messages = [{"role": "user", "content": "Hello, how are you today?"}]
    ids = checkpoint.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    cpu = speak(checkpoint.folder, "cpu", torch.float32, ids)
    gpu = speak(checkpoint.folder, "cuda", torch.float32, ids)
    assert gpu[0] == cpu[0]
    assert torch.equal(gpu[1], cpu[1])
    noise = (gpu[2] - cpu[2]).pow(2).sum().clamp_min(1e-30)
    assert float(10 * torch.log10(cpu[2].pow(2).sum() / noise)) >= 40.0
    tokens, frames, audio = speak(checkpoint.folder, "cuda", torch.bfloat16, ids)
    assert len(tokens) >= 1 and frames.shape[1] == 48
    assert torch.isfinite(audio).all() and float(audio.abs().max()) <= 1.0
