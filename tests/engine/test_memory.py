"""GPU memory budgets: the KV sizing arithmetic (numbers), the profile steps (run on the CPU),
and the allocator cap a stage process applies (with a stand-in for torch.cuda: a CPU has none).
The same on a real GPU: test_memory_gpu.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from omni_server.compiler.plan import BackendRef, ProcessInstance, StageSpec
from omni_server.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from omni_server.engine.config import DEFAULT_MAX_TOTAL_TOKENS
from omni_server.engine.memory import (
    GiB,
    KVBudget,
    MemoryBudgetError,
    MiB,
    check_host_kv,
    check_pinned,
    fmt_bytes,
    margin_bytes,
    size_kv_cache,
)
from omni_server.engine.workspace import graph_static_bytes, measure_workspace
from omni_server.stage.budgets import BudgetError, enforce, process_budgets
from tests.engine.conftest import TINY

# SmolLM2-135M in bf16 on an H200: 30 layers x 3 KV heads x 64 x 2 (K, V) x 2 bytes a token
SMOL_TOKEN = 2 * 30 * 3 * 64 * 2


def _budget(fraction: float, resident: int = 270 * MiB, workspace: int = 120 * MiB) -> KVBudget:
    return KVBudget(
        device="cuda:0",
        total=140 * GiB,
        fraction=fraction,
        resident=resident,
        workspace=workspace,
        token_bytes=SMOL_TOKEN,
        num_tensors=60,
        block_size=16,
    )


def test_the_kv_cache_takes_what_the_budget_leaves() -> None:
    b = _budget(0.3)
    assert b.budget == int(140 * GiB * 0.3)
    assert b.margin == int(b.budget * 0.02)  # 2% of 42 GiB is above the 64 MiB floor
    assert b.rounding == 60 * 2 * MiB
    assert b.kv_bytes == b.budget - 270 * MiB - 120 * MiB - b.margin - b.rounding
    tokens = size_kv_cache(b, max_seq_len=8192)
    assert tokens == b.max_tokens and tokens % 16 == 0
    # the largest whole number of blocks (plus the scratch block) that fits the KV bytes
    assert b.bytes_for(tokens) <= b.kv_bytes < b.bytes_for(tokens + 16)
    assert tokens > 1_800_000  # ~40 GiB at 22.5 KiB a token


def test_the_margin_has_a_floor() -> None:
    assert margin_bytes(1 * GiB) == 64 * MiB
    assert margin_bytes(100 * GiB) == 2 * GiB


def test_a_fraction_with_no_room_for_one_request_is_a_one_line_error() -> None:
    with pytest.raises(MemoryBudgetError) as caught:
        size_kv_cache(_budget(0.001), max_seq_len=8192)
    message = str(caught.value)
    assert message.startswith("gpu_memory_fraction 0.001 of cuda:0 (140.0 GiB) leaves -"), message
    assert "MiB for the KV cache after 270 MiB of weights, 120 MiB of workspace and " in message
    assert "one request of max_seq_len 8192 needs 180 MiB" in message
    assert "\n" not in message


def test_a_budget_that_holds_less_than_one_request_is_refused_too() -> None:
    # positive room, but less than max_seq_len tokens
    b = _budget(0.005)  # 717 MiB: ~143 MiB left for the KV cache
    assert 0 < b.max_tokens < 8192
    with pytest.raises(MemoryBudgetError, match="one request of max_seq_len 8192 needs"):
        size_kv_cache(b, max_seq_len=8192)
    assert size_kv_cache(b, max_seq_len=1024) == b.max_tokens


def test_a_pinned_max_total_tokens_is_checked_against_the_same_budget() -> None:
    b = _budget(0.1)
    check_pinned(b, b.max_tokens)  # the most that fits, fits
    with pytest.raises(MemoryBudgetError) as caught:
        check_pinned(b, b.max_tokens + 16)
    message = str(caught.value)
    assert message.startswith(f"engine.max_total_tokens {b.max_tokens + 16} needs ")
    assert f"(at most {b.max_tokens} tokens fit)" in message


def test_the_sizing_line_names_every_term() -> None:
    line = _budget(0.3).describe()
    for term in (
        "gpu_memory_fraction 0.3 of cuda:0 (140.0 GiB) = 42.0 GiB",
        "weights 270 MiB",
        "workspace 120 MiB",
        "margin 860 MiB",
        "allocator rounding 120 MiB",
        "tokens (22.5 KiB a token)",
    ):
        assert term in line, (term, line)
    assert fmt_bytes(-200 * MiB) == "-200 MiB" and fmt_bytes(1.5 * GiB) == "1.5 GiB"


def test_graph_static_bytes_counts_every_bucket() -> None:
    # buckets: batch 1, 2; context 256 -> logits b x V x 4, greedy tokens and inputs, each in
    # 512-byte blocks; paged: the token rows, lengths and the 16-block table in one buffer
    def blocks(n: int) -> int:
        return -(-n // 512) * 512

    common = {b: blocks(b * 100 * 4) + 2 * blocks(b * 8) for b in (1, 2)}
    gathered = sum(
        common[b] + blocks(3 * b * 8) + blocks(b * 256 * 8) + blocks(b * 256) for b in (1, 2)
    )
    paged = sum(common[b] + blocks(3 * b * 8 + -(-(b + b * 16) // 2) * 8) for b in (1, 2))
    assert graph_static_bytes(100, 2, 256, paged=False, block_size=16) == gathered
    assert graph_static_bytes(100, 2, 256, paged=True, block_size=16) == paged
    assert paged < gathered  # the table is L / block_size int32s, not L int64 slots + a mask


# ---- the engine's configuration and the CPU path -----------------------------------------


def test_engine_config_fraction_and_defaults() -> None:
    assert EngineConfig().max_total_tokens is None
    assert not EngineConfig(gpu_memory_fraction=0.5).sized_from_fraction  # the CPU
    assert EngineConfig(device="cuda", gpu_memory_fraction=0.5).sized_from_fraction
    assert not EngineConfig(
        device="cuda", gpu_memory_fraction=0.5, max_total_tokens=4096
    ).sized_from_fraction
    for bad in (0, 1.5, "half", True):
        with pytest.raises(ValueError, match="gpu_memory_fraction must be a number in"):
            EngineConfig(gpu_memory_fraction=bad)  # type: ignore[arg-type]


def test_the_cpu_engine_keeps_its_default_budget() -> None:
    engine = Engine.from_random(TINY, EngineConfig(max_batch_size=4, max_step_tokens=64))
    assert engine.memory is None
    assert engine.cache.capacity_tokens == DEFAULT_MAX_TOTAL_TOKENS
    # a fraction means nothing on the CPU: the cache is not sized from it
    engine = Engine.from_random(TINY, EngineConfig(max_total_tokens=256, gpu_memory_fraction=0.1))
    assert engine.memory is None and engine.cache.capacity_tokens == 256


@pytest.mark.parametrize(
    ("batch", "step", "seq"), [(4, 64, 512), (1, 8, 512), (8, 600, 512), (2, 64, 40)]
)
def test_the_profile_steps_run_at_the_largest_shapes(batch: int, step: int, seq: int) -> None:
    shape = dataclasses.replace(TINY, max_position_embeddings=seq)
    config = EngineConfig(max_batch_size=batch, max_step_tokens=step)
    engine = Engine.from_random(shape, config)
    workspace = measure_workspace(engine.model, config, seq)  # every forward runs; CPU reads 0
    assert workspace.total == 0
    # the engine is untouched by the profile (its own cache was never written)
    out = engine.generate(
        [GenerationRequest("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4))]
    )
    assert out["r"][-1].finished


def test_after_a_step_out_of_memory_aborting_its_requests_leaves_the_engine_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the "ar" scheduler does on an OOM in step() (stage/scheduling/ar.py): abort every
    request the engine holds. Their blocks come back, and the next request decodes as on a fresh
    engine. The OOM is SIMULATED (the runner raises torch.OutOfMemoryError): a CPU has no CUDA
    memory."""
    config = EngineConfig(max_total_tokens=256, max_batch_size=4, max_step_tokens=64)
    engine = Engine.from_random(TINY, config, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    for i in range(3):
        engine.add(GenerationRequest(f"r{i}", list(range(1, 20 + i)), greedy))
    engine.step()  # they run and hold KV blocks
    assert engine.cache.allocator.num_free < engine.cache.allocator.num_blocks
    real_run = engine.runner.run

    def out_of_memory(batch: object) -> object:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

    monkeypatch.setattr(engine.runner, "run", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        engine.step()
    monkeypatch.setattr(engine.runner, "run", real_run)
    for i in range(3):
        assert engine.abort(f"r{i}")
    assert engine.cache.allocator.num_free == engine.cache.allocator.num_blocks
    prompt = list(range(3, 40))
    after = engine.generate([GenerationRequest("next", prompt, greedy)])
    fresh = Engine.from_random(TINY, config, seed=5).generate(
        [GenerationRequest("next", prompt, greedy)]
    )
    aborts = [e for e in after.values() if e and e[-1].finish_reason is not None]
    assert len(aborts) == 4  # three aborted, and the new one finished
    tokens = [t for e in after["next"] for t in e.token_ids]
    assert tokens == [t for e in fresh["next"] for t in e.token_ids] and len(tokens) == 6


# ---- the allocator cap in the stage process --------------------------------------------------


class StandInCuda:
    """torch.cuda's four functions that budgets.enforce calls, for a device of `total` bytes
    with `free` bytes free: a CPU machine has no CUDA to cap."""

    def __init__(self, total: int, free: int) -> None:
        self.total, self.free = total, free
        self.caps: dict[int, float] = {}

    def is_available(self) -> bool:
        return True

    def mem_get_info(self, device: int) -> tuple[int, int]:
        return self.free, self.total

    def set_per_process_memory_fraction(self, fraction: float, device: int) -> None:
        self.caps[device] = fraction


def _stages(fractions: dict[str, float | None]) -> dict[str, StageSpec]:
    return {
        name: StageSpec(
            name=name,
            directory=Path("/x"),
            backend=BackendRef(Path("/x/model.py"), "B"),
            gpu=(0,),
            gpu_memory_fraction=fraction,
        )
        for name, fraction in fractions.items()
    }


def _instance(devices: dict[str, int | None]) -> ProcessInstance:
    return ProcessInstance("p", 0, 0, tuple(devices), devices)


def test_a_process_budgets_the_largest_fraction_its_stages_declare_per_gpu() -> None:
    stages = _stages({"a": 0.2, "b": 0.3, "c": 0.1, "cpu": None})
    instance = _instance({"a": 0, "b": 0, "c": 1, "cpu": None})
    assert process_budgets(instance, stages) == {0: (0.3, "b"), 1: (0.1, "c")}
    cuda = StandInCuda(total=100 * GiB, free=90 * GiB)
    assert enforce(instance, stages, cuda) == {0: 0.3, 1: 0.1}
    assert cuda.caps == {0: 0.3, 1: 0.1}


def test_a_gpu_without_a_declared_fraction_is_not_capped() -> None:
    stages = _stages({"a": None})
    cuda = StandInCuda(total=100 * GiB, free=1 * GiB)
    assert enforce(_instance({"a": 0}), stages, cuda) == {}
    assert cuda.caps == {}


def test_a_budget_larger_than_the_free_memory_is_a_start_error() -> None:
    stages = _stages({"thinker": 0.5})
    cuda = StandInCuda(total=140 * GiB, free=int(12.3 * GiB))
    with pytest.raises(BudgetError) as caught:
        enforce(_instance({"thinker": 0}), stages, cuda)
    assert str(caught.value) == (
        "stage thinker: gpu_memory_fraction 0.5 of cuda:0 is 70.0 GiB, but only 12.3 GiB is free"
    )
    assert cuda.caps == {}  # nothing capped: the stage does not start


def test_a_cpu_kv_cache_the_host_cannot_hold_is_refused(make_tiny_engine) -> None:
    """Issue 42.2: `engine.max_total_tokens` is a count a load's config can raise; on the CPU
    its cache is host memory, zeroed at once, so one past what the host has available is
    refused at start (the stage fails to start, the old version serves) instead of taking the
    machine's memory from every process on it."""
    with pytest.raises(MemoryBudgetError) as caught:
        make_tiny_engine(max_total_tokens=1 << 40)
    message = str(caught.value)
    assert message.startswith(f"engine.max_total_tokens {1 << 40} needs ")
    assert "host memory" in message and "tokens fit" in message
    assert make_tiny_engine(max_total_tokens=1024).cache.capacity_tokens >= 1024  # what fits


def test_host_kv_arithmetic() -> None:
    check_host_kv(1000, 1024, 1000 * 1024)  # exactly fits
    with pytest.raises(MemoryBudgetError, match=r"at most 999 tokens fit"):
        check_host_kv(1000, 1024, 999 * 1024 + 5)
