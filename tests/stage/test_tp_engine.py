"""A thinker-like "ar" stage on the engine's Llama, tensor-parallel over two ranks through the
runtime: the tokens of one unsharded engine; aborts and one-rank failures keep the ranks in
step (the next request still completes with the right tokens); a rank that dies fails the
group's requests instead of hanging them. CPU ranks over gloo; the same over NCCL on two GPUs.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.plan import Plan
from omni_server.pipeline import PipelineError
from tests.fixtures import FIXTURES
from tests.fixtures.tp_stages import build_engine
from tests.helpers.repo import make_repo, toml
from tests.helpers.runtime import running

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # torch processes

ENGINE = {"max_total_tokens": 1024, "max_batch_size": 8, "max_step_tokens": 64}


def _plan(
    root: Path, tp_size: int = 2, gpu: str = "", dtype: str = "float32", shape: str = ""
) -> Plan:
    engine = "".join(f"{k} = {v}\n" for k, v in ENGINE.items()) + f'dtype = "{dtype}"\n'
    stage = (
        'backend = "model.py:TokenThinker"\nterminal = true\n'
        f"tp_size = {tp_size}\n{gpu}\n"
        '[scheduler]\nkind = "ar"\n'
        f"[engine]\n{engine}"
        f"[parameters]\nseed = 7\n{shape}"
    )
    make_repo(
        root,
        {"thinker": stage},
        toml("""
            [models.m]
            entry = "thinker"
            tasks = ["chat"]
        """),
        {"thinker": FIXTURES / "tp_stages.py"},
    )
    return compile_repository(root)


def _prompt(i: int, n: int = 20) -> list[int]:
    return [(11 * j + 5 * i) % 250 + 1 for j in range(n)]


def _expected(prompts: dict[str, dict[str, Any]], device: str = "cpu", dtype: str = "float32"):
    """The tokens of the unsharded engine, one request at a time (greedy / seeded)."""
    from omni_server.engine import GenerationRequest, SamplingParams
    from omni_server.engine.parallel import SINGLE

    torch.set_num_threads(1)
    engine = build_engine({"seed": 7}, {**ENGINE, "dtype": dtype}, device, SINGLE)
    out = {}
    for name, inputs in prompts.items():
        params = SamplingParams(
            temperature=inputs.get("temperature", 0.0),
            seed=inputs.get("seed"),
            max_tokens=inputs["max_tokens"],
            ignore_eos=True,
        )
        events = engine.generate([GenerationRequest(name, inputs["prompt"], params)])[name]
        out[name] = [t for e in events for t in e.token_ids]
    return out


async def _run(runtime: Any, inputs: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    model = runtime.plan.models["m"]
    async with runtime.submit(model, inputs) as handle:
        chunks = [t async for c in handle for t in c["tokens"]]
        return chunks, await handle.result()


GREEDY = {"prompt": _prompt(0), "max_tokens": 12}
SAMPLED = {"prompt": _prompt(1, 70), "max_tokens": 12, "temperature": 0.9, "seed": 3}


async def test_tp2_thinker_samples_the_tokens_of_tp1(tmp_path: Path) -> None:
    expected = _expected({"greedy": GREEDY, "sampled": SAMPLED})
    async with running(_plan(tmp_path)) as runtime:
        assert sorted(runtime.processes()) == ["thinker@r0/tp0", "thinker@r0/tp1"]
        (g_chunks, g), (s_chunks, s), (_, u) = await asyncio.gather(
            _run(runtime, GREEDY),
            _run(runtime, SAMPLED),
            # unseeded: the leader picks a seed for both ranks (the fixture checks they agree)
            _run(runtime, {"prompt": _prompt(2), "max_tokens": 12, "temperature": 1.0}),
        )
    assert g["tokens"] == g_chunks == expected["greedy"]
    assert s["tokens"] == s_chunks == expected["sampled"]
    assert len(u["tokens"]) == 12 and u["finish_reason"] == "length"


async def test_an_abort_mid_generation_keeps_the_ranks_in_step(tmp_path: Path) -> None:
    expected = _expected({"next": GREEDY})
    async with running(_plan(tmp_path)) as runtime:
        model = runtime.plan.models["m"]
        for _ in range(2):
            long = runtime.submit(model, {"prompt": _prompt(3), "max_tokens": 400})
            seen = 0
            async for chunk in long:
                seen += len(chunk["tokens"])
                if seen >= 3:
                    break
            await long.abort()  # reaches the peer as an op between two steps
            with pytest.raises(PipelineError) as caught:
                await long.result()
            assert caught.value.code == "aborted"
        tokens, result = await _run(runtime, GREEDY)
    assert tokens == result["tokens"] == expected["next"]


@pytest.mark.parametrize("rank", [1, 0])
async def test_a_failure_on_one_rank_fails_the_step_everywhere(tmp_path: Path, rank: int) -> None:
    expected = _expected({"next": GREEDY})
    async with running(_plan(tmp_path)) as runtime:
        model = runtime.plan.models["m"]
        with pytest.raises(PipelineError) as caught:
            await _run(runtime, {"prompt": _prompt(4), "max_tokens": 8, "fail_on_rank": rank})
        assert caught.value.code == "stage_failed"
        assert f"TP rank {rank}" in str(caught.value) or f"rank(s) {rank}" in str(caught.value)
        tokens, _ = await _run(runtime, GREEDY)  # both ranks dropped the failed step
        assert tokens == expected["next"]
        assert sorted(runtime.processes()) == ["thinker@r0/tp0", "thinker@r0/tp1"]
        assert model is runtime.plan.models["m"]


async def test_a_dead_rank_fails_the_groups_requests_and_stops_the_group(tmp_path: Path) -> None:
    async with running(_plan(tmp_path)) as runtime:
        model = runtime.plan.models["m"]
        handle = runtime.submit(model, {"prompt": _prompt(5), "max_tokens": 400})
        async for _ in handle:
            break  # generating: both ranks are in the step loop
        os.kill(runtime.processes()["thinker@r0/tp1"], signal.SIGKILL)
        with pytest.raises(PipelineError) as caught:
            await asyncio.wait_for(handle.result(), timeout=60)
        assert caught.value.code == "process_died"
        with pytest.raises(PipelineError) as refused:  # the group is not restarted
            await asyncio.wait_for(_run(runtime, GREEDY), timeout=30)
        assert refused.value.code == "unavailable", refused.value


async def test_a_tp_size_the_heads_cannot_split_is_refused_at_start(tmp_path: Path) -> None:
    # SmolLM2-135M's shape: 9 heads / 3 KV heads over 2 ranks
    plan = _plan(tmp_path, shape='shape = "smollm2-135m"\n')
    with pytest.raises(PipelineError, match=r"thinker.*tp_size = 2 .*num_heads = 9"):
        async with running(plan):
            pass


@pytest.mark.gpu2
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_tp2_thinker_over_nccl_on_two_gpus(tmp_path: Path, dtype: str) -> None:
    """gpu = [0, 1]: NCCL, CUDA graphs. float32: the tokens of TP=1 on one GPU; bfloat16 rounds
    each rank's partial sums: report how many tokens match."""
    expected = _expected({"greedy": GREEDY, "sampled": SAMPLED}, "cuda:0", dtype)
    async with running(_plan(tmp_path, gpu="gpu = [0, 1]", dtype=dtype)) as runtime:
        (g_chunks, g), (_, s) = await asyncio.gather(_run(runtime, GREEDY), _run(runtime, SAMPLED))
        long = runtime.submit(runtime.plan.models["m"], {"prompt": _prompt(3), "max_tokens": 200})
        async for _ in long:
            break
        await long.abort()
        _, after = await _run(runtime, GREEDY)  # in step after an abort
    got = {"greedy": g["tokens"], "sampled": s["tokens"]}
    same = sum(a == b for k in got for a, b in zip(got[k], expected[k], strict=True))
    print(f"\nruntime TP=2 over NCCL, {dtype}: {same}/24 tokens equal to TP=1")
    assert after["tokens"] == g["tokens"] == g_chunks
    if dtype == "float32":
        assert got == expected


def test_the_embedded_thinker_refuses_tp2_naming_its_heads() -> None:
    """SmolLM2-135M has 9 heads / 3 KV heads: tp_size = 2 cannot split them."""
    from omni_server.backend import StageConfigError, StageContext
    from omni_server.compiler.compiler import compile_repository as compile_repo
    from omni_server.stage.backends import load_backend

    repository = Path(__file__).resolve().parents[2] / "repository"
    spec = compile_repo(repository).stages["thinker"]
    thinker = load_backend(spec)
    context = StageContext(
        stage="thinker",
        parameters=dict(spec.parameters),
        device="cpu",
        repository=repository,
        stage_dir=spec.directory,
        tp_rank=0,
        tp_size=2,
        process_group=object(),  # never used: the shape is refused first
        engine=dict(spec.engine.settings) if spec.engine else {},
    )
    with pytest.raises(StageConfigError, match=r"tp_size = 2 must divide .*num_heads = 9"):
        thinker.initialize(context)
