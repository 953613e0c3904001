"""The qwen3_omni_talker family (engine/families/qwen3_omni_talker) on a tiny random Qwen3-Omni
checkpoint, against models/qwen3_omni/talker_batch.py (the plain-torch talker the served tests
check against transformers' codes, frame for frame):

- greedy and seeded-sampled frames (every code group) equal talker_batch's for the same prompt,
  text and seed; alone and among other requests of other lengths alike;
- a step holds several talker rows (continuous batching, read off the batcher's batches);
- a row whose text is not in yet sits the step out (Head.ready), without preemption, and goes
  on with the same frames once its text comes;
- abort and the end of a request give every KV block back;
- on CUDA in fp32, eager and through CUDA graphs, the CPU's frames (marked gpu).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_server.engine import Engine, EngineConfig
from omni_server.engine.families.qwen3_omni_talker.checkpoint import talker_engine
from omni_server.engine.families.qwen3_omni_talker.head import TalkerFeed, TalkerHead
from omni_server.engine.sampling import SamplingParams
from omni_server.engine.sequence import GenerationRequest, TokenEvent
from omni_server.models.qwen3_omni import talker_batch
from omni_server.models.qwen3_omni.talker import Talker
from omni_server.models.qwen3_omni.talker_batch import CodeSampling

FRAMES = 20
GREEDY = CodeSampling(temperature=0.0, suppress_eos=True)
SAMPLED = CodeSampling(temperature=0.9, suppress_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_bench.random_qwen3_omni import write_qwen3_omni

    return write_qwen3_omni(tmp_path_factory.mktemp("talker") / "ckpt", "tiny", seed=0)


@pytest.fixture(scope="module")
def reference(folder: Path) -> Talker:
    return Talker.from_checkpoint(folder)[0]


def config(device: str = "cpu", **kw: Any) -> EngineConfig:
    return EngineConfig(**{"device": device, "dtype": "float32", "max_total_tokens": 2048,
                           "max_batch_size": 8, **kw})  # fmt: skip


@pytest.fixture(scope="module")
def engine(folder: Path) -> Engine:
    return talker_engine(folder, config())


@dataclass
class Speech:
    """One request's inputs: a prompt of `length` rows and `texts` thinker tokens."""

    name: str
    length: int
    texts: list[int]
    sampling: CodeSampling = GREEDY
    seed: int | None = None

    def prompt(self, width: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.length * 31 + len(self.texts))
        return torch.randn(self.length, width, generator=g)


SPEECHES = [
    Speech("a", 11, [5, 6, 7, 8]),
    Speech("b", 23, [9, 10], SAMPLED, seed=3),
    Speech("c", 7, [11, 12, 13, 14, 15, 16, 17]),
    Speech("d", 17, [1], SAMPLED, seed=4),
]


def talker_batch_frames(reference: Talker, engine: Engine, speech: Speech) -> list[list[int]]:
    """The frames of talker_batch's loop (as the stage ran it before the engine)."""
    model = engine.model
    prompt = speech.prompt(model.shape.hidden_size)[None]
    ids = model.config
    texts = model.hear(speech.texts)
    _, eos, pad = model.hear([ids.tts_bos_token_id, ids.tts_eos_token_id,
                              ids.tts_pad_token_id]).unbind(0)  # fmt: skip
    state = talker_batch.start(reference, prompt, FRAMES, speech.sampling, speech.seed)
    frames: list[list[int]] = []
    while state.frames < FRAMES:
        code0 = talker_batch.choose_code0s(reference, [state])
        frames += talker_batch.complete(reference, [state], code0)
        k = state.frames - 1
        text = texts[k] if k < len(texts) else (eos if k == len(texts) else pad)
        talker_batch.advance(reference, [state], text[None, None])
    return frames


def add(engine: Engine, speech: Speech, heard: bool = True) -> TalkerFeed:
    model = engine.model
    head = model.head
    assert isinstance(head, TalkerHead)
    feed = TalkerFeed(speech.prompt(model.shape.hidden_size), speech.sampling)
    if heard:
        feed.hear(model.hear(speech.texts), done=True)
    head.expect(speech.name, feed)
    params = SamplingParams(seed=speech.seed, max_tokens=FRAMES)
    engine.add(GenerationRequest(speech.name, [0] * speech.length, params))
    return feed


def run(engine: Engine, speeches: list[Speech]) -> dict[str, list[TokenEvent]]:
    for speech in speeches:
        add(engine, speech)
    out: dict[str, list[TokenEvent]] = {s.name: [] for s in speeches}
    while engine.has_work():
        for event in engine.step():
            out[event.request_id].append(event)
    return out


def frames(events: list[TokenEvent]) -> list[list[int]]:
    return [f for e in events for f in e.audio_frames]


def test_frames_equal_talker_batch_alone_and_together(engine: Engine, reference: Talker) -> None:
    torch.set_num_threads(1)
    expected = {s.name: talker_batch_frames(reference, engine, s) for s in SPEECHES}
    for speech in SPEECHES:
        events = run(engine, [speech])[speech.name]
        assert frames(events) == expected[speech.name], speech.name
        assert events[-1].finish_reason == "length" and len(frames(events)) == FRAMES
    decodes: list[int] = []
    batcher = engine.batcher
    next_batch = batcher.next_batch

    def spy(*args: Any, **kwargs: Any) -> Any:  # the real batcher's batch, its size noted
        batch = next_batch(*args, **kwargs)
        if batch is not None:
            decodes.append(len(batch.decodes))
        return batch

    batcher.next_batch = spy  # type: ignore[method-assign]
    try:
        together = run(engine, SPEECHES)
    finally:
        del batcher.next_batch
    for speech in SPEECHES:
        assert frames(together[speech.name]) == expected[speech.name], speech.name
    assert max(decodes) == len(SPEECHES)  # every talker row in one step
    assert batcher.num_preemptions == 0
    # a sampled speech differs from its greedy run: the seeds were used
    assert expected["b"] != frames(run(engine, [Speech("b", 23, [9, 10])])["b"])


def test_a_row_waits_for_its_text_then_goes_on_unchanged(engine: Engine, reference: Talker) -> None:
    speech = Speech("late", 9, [3, 4, 5])
    expected = talker_batch_frames(reference, engine, speech)
    feed = add(engine, speech, heard=False)
    got: list[list[int]] = []
    for _ in range(5):  # the prefill gives frame 0; frame 0's next input needs text 0
        for event in engine.step():
            got += event.audio_frames
    assert len(got) == 1 and engine.num_running == 1 and engine.has_work()
    assert engine.batcher.num_preemptions == 0
    model = engine.model
    for i, token in enumerate(speech.texts):
        feed.hear(model.hear([token]), done=i == len(speech.texts) - 1)
        for event in engine.step():
            got += event.audio_frames
        assert len(got) == i + 2  # one frame a text, never ahead of it
    while engine.has_work():
        for event in engine.step():
            got += event.audio_frames
    assert got == expected


def test_preemption_recomputes_the_same_frames(folder: Path, reference: Talker) -> None:
    """A cache of 4 blocks for two speeches of 31 and 43 positions: the newer one is preempted
    (its prompt and frames recomputed from the head's state) and both keep their frames."""
    small = talker_engine(folder, config(max_total_tokens=64, block_size=16))
    speeches = [SPEECHES[0], Speech("e", 23, [9, 10])]
    expected = {s.name: talker_batch_frames(reference, small, s) for s in speeches}
    got = run(small, speeches)
    assert small.batcher.num_preemptions > 0
    for speech in speeches:
        assert frames(got[speech.name]) == expected[speech.name], speech.name
    assert small.cache.allocator.num_free == 4


def test_abort_and_the_end_free_every_kv_block(engine: Engine) -> None:
    allocator = engine.cache.allocator
    full = allocator.num_free
    add(engine, SPEECHES[0])
    add(engine, SPEECHES[2])
    for _ in range(4):
        engine.step()
    assert allocator.num_free < full and engine.num_running == 2
    assert engine.abort(SPEECHES[0].name)
    assert engine.num_running == 1
    while engine.has_work():
        engine.step()
    assert allocator.num_free == full


def test_a_request_without_its_feed_is_refused(engine: Engine) -> None:
    with pytest.raises(ValueError, match="TalkerFeed"):
        engine.add(GenerationRequest("lost", [0] * 4, SamplingParams(max_tokens=2)))
    assert not engine.has_work()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graphs"])
def test_cuda_fp32_gives_the_cpus_frames(engine: Engine, folder: Path, graphs: bool) -> None:
    """Greedy and seeded-sampled frames on CUDA equal the CPU's: the talker's forward and, with
    graphs, the code predictor's frames replayed from its captured graphs (head.capture_draws)
    draw the same codes as the CPU's eager run."""
    on_cpu = run(engine, SPEECHES)
    gpu = talker_engine(folder, config("cuda", cuda_graphs=graphs))
    assert (gpu.runner.graphs is not None) == graphs
    head = gpu.model.head
    assert isinstance(head, TalkerHead) and (head.graphs is not None) == graphs
    on_gpu = run(gpu, SPEECHES)
    for speech in SPEECHES:
        assert frames(on_gpu[speech.name]) == frames(on_cpu[speech.name]), speech.name
