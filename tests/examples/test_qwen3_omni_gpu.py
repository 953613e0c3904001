"""examples/qwen3-omni's thinker half on a machine with a GPU: the audio tower and the thinker
place themselves on cuda:0 with no override (the thinker in bf16, its decode graphs), and, in
fp32 there (two overrides), an audio prompt's greedy ids and the talker's hidden state equal
transformers' on the CPU, as tests/examples/test_qwen3_omni_thinker_served.py checks on the CPU
(the same probe stands in for the talker). The GPU tier (docs/gpu.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_server.contracts import AudioPart
from tests.examples.test_qwen3_omni_thinker_served import (
    CLIP,
    QUESTION,
    ask,
    chat,
    check_handoff,
    perturb_norms,
    references,
    repository,
)

transformers = pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


async def test_the_thinker_half_on_the_gpu_hears_as_transformers(tmp_path: Path) -> None:
    from omni_bench.random_qwen3_omni import write_qwen3_omni
    from omni_server.compiler import compile_repository
    from omni_server.compiler.plan import MachineFacts
    from tests.helpers.runtime import running

    machine = MachineFacts(gpus=torch.cuda.device_count())  # as the CLI finds it (gpu.discover)

    folder = write_qwen3_omni(tmp_path / "ckpt", "tiny", seed=0)
    perturb_norms(folder, 0)
    _, expected, _ = references(folder)
    assert expected.hidden is not None
    root = repository(tmp_path / "repo")
    overrides = ["--parameters.checkpoint", str(folder)]
    placed = compile_repository(root, overrides, machine)
    thinker = placed.stages["thinker"]
    assert thinker.gpu == (0,) and placed.stages["audio_encoder"].gpu == (0,)
    assert thinker.engine is not None and thinker.engine.settings["dtype"] == "bfloat16"
    overrides += ["--stages.thinker.parameters.ignore_eos", "true",
                  "--stages.thinker.engine.dtype", "float32",
                  "--stages.audio_encoder.parameters.dtype", "float32"]  # fmt: skip
    async with running(compile_repository(root, overrides, machine)) as runtime:
        spoken = await ask(runtime, chat(AudioPart(CLIP, "wav"), QUESTION))
    check_handoff(spoken, expected)
    assert spoken.talker["tokens"] == expected.tokens
    hidden = spoken.talker["opening"]["hidden"]
    torch.testing.assert_close(hidden, expected.hidden, atol=1e-3, rtol=1e-3)
