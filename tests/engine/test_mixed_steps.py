"""Mixed steps (decode rows and prefill chunks in one step) and prefill attention.

A mixed step replays the decode graph for its decode rows and runs the chunks eagerly beside it
(runner.py, the split launch); prefill chunks attend through SDPA with `enable_gqa`, causal and
aligned bottom-right for a chunk after the first (attention.prefill_attention).

On the CPU no CUDA graph exists, so the split path runs with `EagerGraphs`, a stand-in for
DecodeGraphs (labelled as such: it takes exactly what a replay takes, the head's static inputs
filled by fill_graph_inputs included, and runs those decode rows alone in an eager forward). Its
tokens and frames must equal the all-eager mixed step's, for the llama family and for Higgs
(whose greedy frames the all-eager engine matches with transformers: test_higgs_audio.py). The
real graphs are compared on a GPU (marked gpu).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from omni_server.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from omni_server.engine.attention import DecodeGroup, ForwardBatch, prefill_attention
from omni_server.engine.batcher import StepBatch
from omni_server.engine.cuda_graphs import DecodeOutput
from omni_server.engine.runner import ModelRunner
from omni_server.engine.sampling import greedy_tokens
from tests.engine.conftest import TINY

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class EagerGraphs:
    """A stand-in for DecodeGraphs where no CUDA graph can be captured (the CPU): `run` gets a
    replay's arguments and runs those decode rows alone, eagerly, as a graph would (the head's
    static inputs through graph_inputs / fill_graph_inputs; for a text head the argmax, kept in
    a device feed that PENDING ids read, as cuda_graphs.py's `feed`)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.replays: list[int] = []  # rows of each replay
        self.feed = torch.zeros(64, dtype=torch.int64)

    def run(
        self,
        ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        tables: list[list[int]],
        context: list[int],
        decodes: list[Any],
    ) -> DecodeOutput:
        runner, n, length = self.runner, len(ids), max(context)
        self.replays.append(n)
        static = runner.head.graph_inputs(n, runner.device)
        if static is not None:
            runner.head.fill_graph_inputs(static, decodes)
        mask = torch.arange(length).unsqueeze(0) < torch.tensor(context).unsqueeze(1)
        slots = runner.cache.slot_matrix(tables, length)
        input_ids = torch.tensor(ids)
        input_ids = torch.where(input_ids < 0, self.feed[:n], input_ids)  # overlap.PENDING
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=torch.tensor(positions),
            slot_mapping=torch.tensor(slot_mapping),
            logits_indices=torch.arange(n),
            decode=DecodeGroup(n, slots, mask[:, None, None, :]),
            prefills=[],
            family_inputs=static,
        )
        logits = runner.model.forward(batch, runner.cache.k, runner.cache.v)
        if not runner.head.argmax_is_draw:
            return DecodeOutput(logits, None)
        self.feed[:n] = greedy_tokens(logits)
        return DecodeOutput(logits, self.feed[:n].clone())


def serve(
    engine: Engine, first: GenerationRequest, later: list[GenerationRequest], join_after: int = 3
) -> tuple[dict[str, list[Any]], list[StepBatch]]:
    """Run `first` alone for `join_after` steps, then add `later` (their prompts prefill in
    chunks beside the running decodes): each request's draws (token ids, or frames) and every
    step's batch."""
    batches: list[StepBatch] = []
    schedule = engine.batcher.next_batch

    def spy(*args: Any, **kwargs: Any) -> StepBatch | None:  # the real scheduler, recorded
        batch = schedule(*args, **kwargs)
        if batch is not None:
            batches.append(batch)
        return batch

    engine.batcher.next_batch = spy  # type: ignore[method-assign]
    out: dict[str, list[Any]] = {}
    engine.add(first)
    for step in range(10_000):
        if step == join_after:
            for request in later:
                engine.add(request)
        if step > join_after and not engine.has_work():
            break
        for event in engine.step():
            out.setdefault(event.request_id, []).extend(event.audio_frames or event.token_ids)
    return out, batches


def mixed(batches: list[StepBatch]) -> int:
    return sum(1 for b in batches if b.decodes and b.prefills)


# --- prefill attention -----------------------------------------------------------------------


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K/V repeated per query head and the dense causal mask of positions ctx - n .. ctx - 1:
    the plainest statement of what a chunk computes (float64)."""
    n, heads, _ = q.shape
    ctx, group = k.shape[0], heads // k.shape[1]
    kr = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
    vr = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    mask = torch.arange(ctx).unsqueeze(0) <= torch.arange(ctx - n, ctx).unsqueeze(1)
    o = F.scaled_dot_product_attention(q.double().transpose(0, 1), kr, vr, attn_mask=mask)
    return o.transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (9, 3)])
@pytest.mark.parametrize("start,n", [(0, 37), (1, 1), (16, 16), (40, 7), (100, 64)])
def test_prefill_attention_equals_repeated_kv_with_a_dense_mask(
    heads: int, kv_heads: int, start: int, n: int
) -> None:
    gen = torch.Generator().manual_seed(start * 7 + n)
    q = torch.randn(n, heads, 16, generator=gen)
    k, v = (torch.randn(start + n, kv_heads, 16, generator=gen) for _ in range(2))
    got = prefill_attention(q, k, v)
    assert got.shape == (n, heads, 16)
    torch.testing.assert_close(got.double(), reference_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_a_later_chunk_sees_the_whole_prefix_and_not_its_future() -> None:
    """Bottom-right alignment: query i of a chunk at start s sees keys 0 .. s + i, so changing
    key s + i + 1 leaves rows 0 .. i alone and changing a prefix key moves every row."""
    gen = torch.Generator().manual_seed(0)
    start, n = 12, 6
    q = torch.randn(n, 4, 8, generator=gen)
    k, v = (torch.randn(start + n, 2, 8, generator=gen) for _ in range(2))
    base = prefill_attention(q, k, v)
    future = v.clone()
    future[start + 3] += 10.0  # visible to rows 3.. only
    moved = (prefill_attention(q, k, future) - base).abs().amax(dim=(1, 2))
    assert torch.all(moved[:3] == 0) and torch.all(moved[3:] > 0)
    prefix = v.clone()
    prefix[0] += 10.0
    assert torch.all((prefill_attention(q, k, prefix) - base).abs().amax(dim=(1, 2)) > 0)


# --- mixed steps through the split launch (CPU: the stand-in graphs) ---------------------------


def _llama_requests() -> tuple[GenerationRequest, list[GenerationRequest]]:
    def params(i: int) -> SamplingParams:
        if i % 2:  # seeded rows too: their draws must not depend on the step's split either
            return SamplingParams(temperature=1.0, seed=i, max_tokens=20, ignore_eos=True)
        return SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    prompts = [[(3 * j + i) % 120 + 1 for j in range(5 + 23 * i)] for i in range(4)]
    first, *later = (GenerationRequest(f"r{i}", p, params(i)) for i, p in enumerate(prompts))
    return first, later


def _llama(device: str = "cpu", **settings: Any) -> Engine:
    # max_step_tokens 24: the later prompts (28..74 tokens) prefill in chunks beside decodes
    config = EngineConfig(
        max_total_tokens=2048, max_batch_size=8, max_step_tokens=24, device=device, **settings
    )
    return Engine.from_random(TINY, config, seed=3)


def test_llama_mixed_steps_through_the_split_launch_equal_all_eager() -> None:
    first, later = _llama_requests()
    eager, eager_batches = serve(_llama(), first, later)
    split_engine = _llama()
    graphs = EagerGraphs(split_engine.runner)
    split_engine.runner.graphs = graphs  # type: ignore[assignment]
    split, batches = serve(split_engine, first, later)
    assert mixed(batches) >= 3 and any(len(b.prefills) for b in batches if b.decodes)
    # every step with decodes replayed "the graph" for exactly its decode rows
    assert graphs.replays == [len(b.decodes) for b in batches if b.decodes]
    assert split == eager
    assert mixed(eager_batches) == mixed(batches)  # the same schedule, step for step


def _greedy_requests() -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"g{i}",
            [(5 * j + i) % 120 + 1 for j in range(6 + 25 * i)],
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        )
        for i in range(3)
    ]


def test_split_mixed_steps_beside_steps_in_flight_change_no_token() -> None:
    """Greedy decode steps go in flight (overlap.py) before and after the mixed steps: the
    mixed ones never do, and the feed the next graph step reads stays the decodes' argmax."""
    requests = _greedy_requests()
    engine = _llama(overlap_decode="on")
    assert engine.overlaps_decode
    graphs = EagerGraphs(engine.runner)
    engine.runner.graphs = graphs  # type: ignore[assignment]
    flown = 0
    launch = engine.runner.run

    def counting(batch: StepBatch) -> Any:  # the real run, its PENDING rows counted
        nonlocal flown
        flown += any(seq.token_ids[seq.num_computed] < 0 for seq in batch.decodes)
        return launch(batch)

    engine.runner.run = counting  # type: ignore[method-assign]
    out, batches = serve(engine, requests[0], requests[1:])
    assert mixed(batches) >= 3 and flown >= 10
    assert out == serve(_llama(), requests[0], requests[1:])[0]


def test_the_old_all_eager_mixed_step_is_kept_behind_split_mixed() -> None:
    first, later = _llama_requests()
    engine = _llama()
    graphs = EagerGraphs(engine.runner)
    engine.runner.graphs = graphs  # type: ignore[assignment]
    engine.runner.split_mixed = False
    out, batches = serve(engine, first, later)
    assert mixed(batches) >= 3
    assert graphs.replays == [len(b.decodes) for b in batches if b.decodes and not b.prefills]
    assert out == serve(_llama(), first, later)[0]


@pytest.fixture(scope="module")
def higgs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_bench.random_checkpoint import write_higgs_audio_v2

    folder = tmp_path_factory.mktemp("ckpt") / "higgs"
    return write_higgs_audio_v2(folder, "tiny", seed=0, audio_eos_scale=0.7)


@pytest.fixture(scope="module")
def higgs(higgs_dir: Path) -> Engine:
    return Engine.from_checkpoint(higgs_dir, EngineConfig(max_total_tokens=4096))


def _higgs_requests(base: Engine) -> tuple[GenerationRequest, list[GenerationRequest]]:
    """A greedy request, then three seeded TTS prompts and one carrying a reference voice (20
    frame rows among its text rows: the chunk's audio and text rows split in DualFFN)."""
    from tests.engine.test_higgs_audio import prompt, turn

    def seeded(i: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, top_k=50, seed=i, max_tokens=24, ignore_eos=True)

    texts = ["The sun rises in the east.", "Hi", "It was the night before my birthday."]
    first = GenerationRequest(
        "g", prompt(base, texts[0]), SamplingParams(temperature=0, max_tokens=60)
    )
    later = [GenerationRequest(f"s{i}", prompt(base, t), seeded(i)) for i, t in enumerate(texts)]
    audio, tokenizer = base.model.audio, base.tokenizer
    assert audio is not None and tokenizer is not None
    conversation = [
        turn("system", "Generate audio following instruction."),
        turn("user", "It was the night before my birthday."),
        {"role": "assistant", "content": [{"type": "audio", "url": "voice.wav"}]},
        turn("user", "The sun rises in the east."),
    ]
    text = tokenizer.apply_chat_template(conversation).replace(
        "<|AUDIO_OUT|>", "<|AUDIO_OUT|>" * 20
    )
    gen = torch.Generator().manual_seed(1)
    voice = torch.randint(0, audio.codebook_size, (20, audio.num_codebooks), generator=gen)
    ids = tokenizer.encode(text)
    later.append(GenerationRequest("voice", ids, seeded(7), audio_codes=voice.tolist()))
    return first, later


def _higgs_engine(base: Engine, **settings: Any) -> Engine:
    # max_step_tokens 48: the later prompts prefill in chunks beside the greedy request's frames
    table: dict[str, object] = {"max_total_tokens": 4096, "max_batch_size": 8}
    table.update(max_step_tokens=48, max_prefill_beside_decodes=32, **settings)
    return Engine(base.model, EngineConfig.from_table(table), base.tokenizer)


def test_higgs_mixed_steps_through_the_split_launch_equal_all_eager(higgs: Engine) -> None:
    """Frame rows through the stand-in graph (its static codes), prompt chunks with their text
    and frame rows eagerly: the same frames as the all-eager mixed step, and the greedy
    request's frames those it generates alone (which transformers' match)."""
    first, later = _higgs_requests(higgs)
    eager, _ = serve(_higgs_engine(higgs), first, later, join_after=2)
    engine = _higgs_engine(higgs)
    graphs = EagerGraphs(engine.runner)
    engine.runner.graphs = graphs  # type: ignore[assignment]
    split, batches = serve(engine, first, later, join_after=2)
    assert mixed(batches) >= 3
    assert graphs.replays == [len(b.decodes) for b in batches if b.decodes]
    assert split == eager
    alone = _higgs_engine(higgs).generate([first])["g"]
    assert split["g"] == [f for e in alone for f in e.audio_frames]


# --- on a GPU: the real graphs, the flash prefill ----------------------------------------------


@pytest.mark.gpu
@GPU
def test_llama_mixed_steps_through_graphs_equal_eager_on_gpu() -> None:
    first, later = _llama_requests()
    engine = _llama("cuda", dtype="float32")
    assert engine.runner.graphs is not None
    graphed, batches = serve(engine, first, later)
    assert mixed(batches) >= 3 and engine.runner.graphs.graphs
    assert graphed == serve(_llama("cuda", dtype="float32", cuda_graphs=False), first, later)[0]
    old = _llama("cuda", dtype="float32")
    old.runner.split_mixed = False
    assert graphed == serve(old, first, later)[0]
    # (not against the CPU engine: Engine.from_random draws its weights on the engine's
    # device, so a CUDA engine and a CPU one of the same seed are different models)
    # all greedy: decode steps in flight (the graphs' device feed) around the mixed steps
    first, *later = _greedy_requests()
    engine = _llama("cuda", dtype="float32")
    assert engine.overlaps_decode
    graphed, batches = serve(engine, first, later)
    assert mixed(batches) >= 3
    assert graphed == serve(_llama("cuda", dtype="float32", cuda_graphs=False), first, later)[0]


@pytest.mark.gpu
@GPU
def test_higgs_mixed_steps_through_graphs_equal_eager_on_gpu(
    higgs_dir: Path, higgs: Engine
) -> None:
    first, later = _higgs_requests(higgs)

    def run(**settings: Any) -> tuple[dict[str, list[Any]], list[StepBatch]]:
        table: dict[str, object] = {
            "max_total_tokens": 4096,
            "max_batch_size": 8,
            "max_step_tokens": 48,
            "max_prefill_beside_decodes": 32,
            "device": "cuda",
        }
        table.update(settings)
        engine = Engine.from_checkpoint(higgs_dir, EngineConfig.from_table(table))
        return serve(engine, first, later, join_after=2)

    graphed, batches = run()
    assert mixed(batches) >= 3
    assert graphed == run(cuda_graphs=False)[0]
    # greedy float32 frames on the GPU equal the CPU engine's (which transformers' match)
    assert graphed["g"] == serve(_higgs_engine(higgs), first, later, join_after=2)[0]["g"]


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("start,n", [(0, 256), (256, 256), (1000, 24), (0, 1024)])
def test_flash_prefill_equals_the_reference_on_gpu(start: int, n: int) -> None:
    """bf16 chunks through flash attention alone (sdpa_kernel: no other backend may run), GQA
    4:1 (head_dim 64) and 3:1 (head_dim 128), against the float64 reference."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(n + start)
    for heads, kv_heads, dim in ((32, 8, 64), (24, 8, 128)):
        q = torch.randn(n, heads, dim, generator=gen)
        k, v = (torch.randn(start + n, kv_heads, dim, generator=gen) for _ in range(2))
        dq, dk, dv = (t.to("cuda", torch.bfloat16) for t in (q, k, v))
        # the reference of the very bf16 inputs: only the kernel's own rounding is compared
        expected = reference_attention(*(t.cpu().double() for t in (dq, dk, dv))).float()
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            got = prefill_attention(dq, dk, dv).float().cpu()
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@GPU
def test_bf16_mixed_steps_split_equal_all_eager_logits_on_gpu() -> None:
    """bf16 with the paged decode kernel and the flash prefill (a first chunk and chunks after a
    prefix): each mixed step's logits through the split launch equal the all-eager step's within
    bf16 rounding, rows in the same order."""
    first, later = _llama_requests()
    engine = _llama("cuda", dtype="bfloat16")
    runner, schedule = engine.runner, engine.batcher.next_batch
    compared: list[tuple[torch.Tensor, torch.Tensor]] = []

    def spy(*args: Any, **kwargs: Any) -> StepBatch | None:
        batch = schedule(*args, **kwargs)
        if batch is not None and batch.decodes and batch.prefills:
            runner.split_mixed = False
            eager, eager_rows, _ = runner.run(batch)
            runner.split_mixed = True
            split, split_rows, _ = runner.run(batch)
            assert split_rows == eager_rows
            compared.append((split.float().cpu(), eager.float().cpu()))
        return batch

    engine.batcher.next_batch = spy  # type: ignore[method-assign]
    engine.add(first)
    for _ in range(3):
        engine.step()
    for request in later:
        engine.add(request)
    while engine.has_work():
        engine.step()
    assert len(compared) >= 3
    for split, eager in compared:
        scale = eager.abs().max()
        assert (split - eager).abs().max() <= 5e-2 * scale  # a row out of order: ~scale
