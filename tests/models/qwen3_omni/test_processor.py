"""transformers' `Qwen3OmniMoeProcessor.from_pretrained` loads the random checkpoint (in a
child process that sees a torchvision stand-in: the processor cannot be built without
torchvision, absent here; text and audio never call it), and its output for a conversation with
audio equals what our code builds: the token ids (the audio placeholder expanded to one per
audio-tower output) and the log-mel features."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_server.models.qwen3_omni.audio_encoder import output_lengths
from omni_server.models.qwen3_omni.mel import log_mel
from tests.models.qwen3_omni.conftest import Checkpoint
from tests.models.qwen3_omni.test_audio import clip

QUESTION = "What is in this audio clip?"
CHILD = """
import sys, numpy as np, torch
from transformers import Qwen3OmniMoeProcessor
folder, audio_file, out = sys.argv[1:4]
processor = Qwen3OmniMoeProcessor.from_pretrained(folder)
content = [{"type": "audio", "audio": "clip.wav"}, {"type": "text", "text": sys.argv[4]}]
messages = [{"role": "user", "content": content}]
text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
batch = processor(text=text, audio=[np.load(audio_file)], return_tensors="pt")
torch.save(dict(batch), out)
"""


@pytest.mark.slow  # a child process importing transformers: ~12 s here
def test_processor_loads_and_agrees_with_ours(checkpoint: Checkpoint, tmp_path: Path) -> None:
    from omni_bench.random_qwen3_omni import torchvision_stand_in

    audio = clip(2.73, checkpoint.seed)
    np.save(tmp_path / "clip.npy", audio)
    paths = [str(torchvision_stand_in(tmp_path / "stand_in")), *sys.path]
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(checkpoint.folder), str(tmp_path / "clip.npy"),
         str(tmp_path / "out.pt"), QUESTION],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")

    tokenizer = checkpoint.tokenizer
    features = log_mel(audio)
    count = int(output_lengths(torch.tensor(features.shape[1])))
    content = [{"type": "audio", "audio": "clip.wav"}, {"type": "text", "text": QUESTION}]
    messages = [{"role": "user", "content": content}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text.replace(tokenizer.audio_token, tokenizer.audio_token * count))["input_ids"]
    assert theirs["input_ids"][0].tolist() == ids
    assert int(theirs["feature_attention_mask"].sum()) == features.shape[1]
    torch.testing.assert_close(theirs["input_features"][0], features, atol=2e-5, rtol=1e-5)
