"""The talker half's stages (examples/qwen3-omni/talker, code2wav) on a CUDA GPU, skipped
without one: in fp32 the frames of 8 concurrent greedy requests IDENTICAL to the CPU's and
their audio within 40 dB; in bf16 (the stages' `dtype = "auto"` there) 8 concurrent requests,
greedy and sampled, run to their 48 frames with audio in range (bf16 products may round
differently with the batch's size, so no equality is asked there). Prints the talker's mean
step time at 1 and 16 requests (junit property `talker_step_ms`; not asserted)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from omni_server.audio import decode
from tests.examples.test_qwen3_omni_talker_served import (
    FRAMES,
    GREEDY,
    Stages,
    repo,  # noqa: F401 (fixture)
    serve,
    snr_db,
    stage,
    talk,
)
from tests.models.qwen3_omni.conftest import Checkpoint, checkpoint  # noqa: F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TEXTS = ["Hi.", "Tell me a story about a dragon.", "What time is it?", "Good morning!"]


def on(device: str, dtype: str, checkpoint: Checkpoint, repo: Any, cpu: Stages) -> Stages:  # noqa: F811
    folder = checkpoint.folder
    return Stages(
        stage(repo, "talker", folder, device, dtype=dtype, **GREEDY),
        stage(repo, "code2wav", folder, device, dtype=dtype),
        cpu.thinker,
        cpu.config,
        cpu.tokenizer,
    )


def requests(stages: Stages, temperature: float = 0.0) -> list[Any]:
    return [
        talk(stages, TEXTS[i % 4], ["Ethan", "Aiden", "Chelsie"][i % 3], start=2 * i,
             every=1 + i % 3, tokens=3 + i, temperature=temperature if i % 2 else 0.0,
             seed=10 + i)
        for i in range(8)
    ]  # fmt: skip


def test_stages_on_cuda_equal_the_cpu_in_fp32_and_run_in_bf16(
    checkpoint: Checkpoint,  # noqa: F811
    repo: Any,  # noqa: F811
    record_property: Any,
) -> None:
    from omni_server.models.qwen3_omni.thinker import Thinker

    thinker, config = Thinker.from_checkpoint(checkpoint.folder)
    cpu = Stages(
        stage(repo, "talker", checkpoint.folder, **GREEDY),
        stage(repo, "code2wav", checkpoint.folder),
        thinker,
        config,
        checkpoint.tokenizer,
    )
    on_cpu = requests(cpu)
    serve(cpu, on_cpu)
    gpu = on("cuda:0", "float32", checkpoint, repo, cpu)
    on_gpu = requests(gpu)
    serve(gpu, on_gpu)
    for one, other in zip(on_cpu, on_gpu, strict=True):
        assert other.frames == one.frames, one.name
        ours, theirs = (decode(bytes(t.audio), "pcm").samples for t in (other, one))
        assert snr_db(theirs, ours) >= 40.0

    bf16 = on("cuda:0", "bfloat16", checkpoint, repo, cpu)
    together = requests(bf16, temperature=0.9)
    serve(bf16, together)
    for request in together:
        assert len(request.frames) == FRAMES
        samples = decode(bytes(request.audio), "pcm").samples
        assert len(samples) > (FRAMES - 1) * 1920 and float(abs(samples).max()) <= 1.0

    times = {}
    for count in (1, 16):
        batch = [talk(bf16, TEXTS[i % 4], "Ethan", tokens=12) for i in range(count)]
        torch.cuda.synchronize()
        begin = time.perf_counter()
        serve(bf16, batch)
        torch.cuda.synchronize()
        times[count] = 1000 * (time.perf_counter() - begin) / FRAMES
    record_property("talker_step_ms", times)
    print(f"talker + code2wav, ms a step (48 frames a request): {times}")
