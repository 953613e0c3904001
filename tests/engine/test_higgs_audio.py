"""Higgs Audio v2 on the engine against transformers' `HiggsAudioV2ForConditionalGeneration`, on
tiny random checkpoints written by `omni-bench random-checkpoint higgs-audio-v2 --size tiny
--audio-eos-scale 0.7` (8 codebooks of 128 codes + the stream BOS / EOS; the end of audio made
rarer, so greedy generations run 51-150 frames instead of ~10-70) for the seeds in SEEDS.

Compared, on every seed: greedy frames IDENTICAL to `generate(do_sample=False)` (the delay
pattern at both ends, the end of audio, the text-track switch), for TTS prompts built as the
reference processor builds them (its chat template: system message, scene, text; the prompt
ids themselves: test_random_checkpoint.py) and for a prompt carrying a reference voice (frame
placeholders + audio codes), every comparison at least MIN_COMPARED frames long and their
counts reported (`record_property` "frames_compared"); the first frame's logits within 1e-3.
The reference's repetition-aware resampling is turned off on its side (`ras_win_len=None`): it
draws from the global RNG, which no engine can match. Then the engine's own guarantees for frames:
seeded sampling reproducible and independent of the batch, preemption and chunked prefill
changing nothing, abort freeing the request's KV blocks.
"""

from __future__ import annotations

import shutil
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_server.engine import (
    Engine,
    EngineConfig,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from tests.engine.test_llama import LOGIT_TOLERANCE

transformers = pytest.importorskip("transformers")

SEEDS = (0, 1, 5)  # the equality tests' checkpoints; the module's own engine (base) is seed 0's
AUDIO_EOS_SCALE = 0.7  # random_checkpoint --audio-eos-scale: long greedy generations
MAX_FRAMES = 150
MIN_COMPARED = 48  # every greedy comparison with transformers covers at least this many frames


def turn(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "content": [{"type": "text", "text": text}]}


def tts(text: str) -> list[dict[str, Any]]:
    """A TTS request as the reference documents it: system message, scene, the text to speak."""
    return [
        turn("system", "Generate audio following instruction."),
        turn("scene", "Audio is recorded from a quiet room."),
        turn("user", text),
    ]


TEXTS = [
    "The sun rises in the east.",
    "Hello there, how are you doing on this fine day? It may not be a holiday.",
    "Hi",
    "It was the night before my birthday. Hooray! It's almost here!",
    "0123456789",
    "This simple fact has been observed by humans for thousands of years.",
]
# compared with transformers on every seed: 51-150 greedy frames each, some ending in EOS on
# each seed ("0123456789" ends after 18 on seed 0)
GREEDY_TEXTS = [t for t in TEXTS if t != "0123456789"]


@pytest.fixture(scope="module")
def higgs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_bench.random_checkpoint import write_higgs_audio_v2

    folder = tmp_path_factory.mktemp("ckpt") / "higgs"
    return write_higgs_audio_v2(folder, "tiny", seed=SEEDS[0], audio_eos_scale=AUDIO_EOS_SCALE)


@pytest.fixture(scope="module")
def base(higgs_dir: Path) -> Engine:
    return Engine.from_checkpoint(higgs_dir, EngineConfig(max_total_tokens=4096))


def make(base: Engine, **settings: object) -> Engine:
    """A fresh engine (own cache, queues) around the one loaded model."""
    table: dict[str, object] = {"max_total_tokens": 4096, "max_batch_size": 8}
    table.update(settings)
    return Engine(base.model, EngineConfig.from_table(table), base.tokenizer)


@pytest.fixture(scope="module")
def hf_higgs(higgs_dir: Path):  # type: ignore[no-untyped-def]
    model = transformers.HiggsAudioV2ForConditionalGeneration.from_pretrained(higgs_dir)
    return model.eval()


@pytest.fixture(scope="module", params=SEEDS, ids=lambda seed: f"seed{seed}")
def seeded(  # type: ignore[no-untyped-def]
    request: pytest.FixtureRequest,
    higgs_dir: Path,
    base: Engine,
    hf_higgs,
    tmp_path_factory: pytest.TempPathFactory,
):
    """(our engine, transformers' model) on one seed's checkpoint: the module's folder with the
    model's weights drawn for that seed (the tokenizer, which no seed changes, kept)."""
    from omni_bench.random_checkpoint import redraw_higgs_audio_v2

    seed = request.param
    if seed == SEEDS[0]:
        return base, hf_higgs
    folder = tmp_path_factory.mktemp(f"seed{seed}") / "higgs"
    shutil.copytree(higgs_dir, folder)
    redraw_higgs_audio_v2(folder, seed, AUDIO_EOS_SCALE)
    engine = Engine.from_checkpoint(folder, EngineConfig(max_total_tokens=4096))
    model = transformers.HiggsAudioV2ForConditionalGeneration.from_pretrained(folder)
    return engine, model.eval()


def report_compared(record_property: Callable[[str, object], None], counts: list[int]) -> None:
    """Says how many frames each greedy comparison covered (junit property, and -s / -rP), and
    fails one that could pass on the delay pattern's opening alone."""
    record_property("frames_compared", counts)
    print(f"frames compared with transformers: {counts} ({sum(counts)} in all)")
    assert min(counts) >= MIN_COMPARED, f"frames compared {counts}: under {MIN_COMPARED}"


def prompt(base: Engine, text: str) -> list[int]:
    assert base.tokenizer is not None
    return base.tokenizer.encode_chat(tts(text))


def frames(events: list[TokenEvent]) -> list[list[int]]:
    return [f for e in events for f in e.audio_frames]


def reference(hf_higgs, ids: list[int], **audio: torch.Tensor) -> list[list[int]]:  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        out = hf_higgs.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_FRAMES,
            do_sample=False,
            ras_win_len=None,
            **audio,
        )
    result: list[list[int]] = out[0].tolist()
    return result


def greedy(max_tokens: int = MAX_FRAMES) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def test_greedy_frames_equal_transformers_generate(seeded, record_property) -> None:  # type: ignore[no-untyped-def]
    base, hf_higgs = seeded
    audio = base.model.audio
    assert audio is not None
    k, bos, eos = audio.num_codebooks, audio.stream_bos_id, audio.stream_eos_id
    ended = 0
    compared = []
    for i, text in enumerate(GREEDY_TEXTS):
        ids = prompt(base, text)
        expected = reference(hf_higgs, ids)
        events = make(base).generate([GenerationRequest("r", ids, greedy())])["r"]
        got = frames(events)
        first = next(
            (n for n, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None
        )
        assert got == expected, (
            f"text {i}: {len(got)} vs {len(expected)} frames, first diff {first}"
        )
        compared.append(len(expected))
        # the delay pattern, visible in the frames: codebook j is BOS for the first j + 1
        # (the random model may also pick the BOS code itself after the opening)
        assert all(f[j] == bos for t, f in enumerate(expected[:k]) for j in range(t, k))
        assert all(len(e.audio_frames) == 1 for e in events)
        if events[-1].finish_reason is FinishReason.STOP:
            ended += 1
            assert expected[-1] == [eos] * k and len(expected) <= MAX_FRAMES
            assert events[-1].token_ids == []
            # the closing delay: from the first EOS on, codebook j is EOS within j + 1 frames
            first = next(n for n, f in enumerate(expected) if eos in f)
            for j in range(k):
                assert all(f[j] == eos for f in expected[first + j + 1 :])
        else:
            assert len(expected) == MAX_FRAMES
    assert ended >= 1, "no prompt reached the end of audio: the EOS path went untested"
    report_compared(record_property, compared)


def test_first_frame_logits_equal_transformers(seeded) -> None:  # type: ignore[no-untyped-def]
    from tests.engine.test_llama import _prefill_logits

    base, hf_higgs = seeded
    ids = prompt(base, TEXTS[1])
    ours = _prefill_logits(base.model, ids, [len(ids)])
    with torch.inference_mode():
        theirs = hf_higgs(input_ids=torch.tensor([ids])).logits[0].float()
    assert ours.shape == theirs.shape  # [T, K * C]: the audio head's
    diff = (ours - theirs).abs().max().item()
    assert diff <= LOGIT_TOLERANCE, f"max |logit diff| {diff}"


def test_reference_voice_prompt_equals_transformers(seeded, record_property) -> None:  # type: ignore[no-untyped-def]
    """Frame placeholders in the prompt embed the given codes through the audio FFN (a prefill
    of text and audio rows together), as the reference's `audio_input_ids` do."""
    from transformers import HiggsAudioV2Processor

    base, hf_higgs = seeded
    audio = base.model.audio
    assert audio is not None and base.tokenizer is not None
    codes = torch.randint(
        0,
        audio.stream_bos_id,
        (1, audio.num_codebooks, 12),
        generator=torch.Generator().manual_seed(0),
    )
    bos = torch.full((1, audio.num_codebooks, 1), audio.stream_bos_id)
    eos = torch.full((1, audio.num_codebooks, 1), audio.stream_eos_id)
    ids_layout = types.SimpleNamespace(
        audio_stream_bos_id=audio.stream_bos_id, audio_stream_eos_id=audio.stream_eos_id
    )
    # the reference processor's own delay-pattern builder: [1, K, n] -> n + K - 1 frames
    delayed = HiggsAudioV2Processor.build_delay_pattern(ids_layout, torch.cat([bos, codes, eos], 2))
    voice = delayed[0].transpose(0, 1)  # [n, K]
    n = voice.shape[0]
    conversation = [
        turn("system", "Generate audio following instruction."),
        turn("user", "It was the night before my birthday."),
        {"role": "assistant", "content": [{"type": "audio", "url": "voice.wav"}]},
        turn("user", "The sun rises in the east."),
    ]
    text = base.tokenizer.apply_chat_template(conversation)
    k = audio.num_codebooks
    text = text.replace(
        "<|AUDIO_OUT|>", "<|AUDIO_OUT|>" * (n - (k - 1)) + "<|reserved_special_token_6|>" * (k - 1)
    )  # the processor's expansion: one position a frame, the last K - 1 delayed
    ids = base.tokenizer.encode(text)
    expected = reference(
        hf_higgs,
        ids,
        audio_input_ids=voice.unsqueeze(0),
        audio_input_ids_mask=torch.ones(1, n, dtype=torch.bool),
    )
    request = GenerationRequest("r", ids, greedy(), audio_codes=voice.tolist())
    events = make(base, max_step_tokens=40).generate([request])["r"]  # chunks cut the voice
    assert expected[:n] == voice.tolist()  # the reference returns the prompt's frames too
    assert frames(events) == expected[n:]
    report_compared(record_property, [len(expected) - n])


def _sampled(seed: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=seed, max_tokens=max_tokens)


def test_seeded_frames_reproducible_and_batch_independent(base: Engine) -> None:
    requests = [
        GenerationRequest(f"r{i}", prompt(base, text), _sampled(100 + i, 20 + 4 * i))
        for i, text in enumerate(TEXTS)
    ]
    alone = {r.request_id: frames(make(base).generate([r])[r.request_id]) for r in requests}
    again = frames(make(base).generate([requests[0]])["r0"])
    assert again == alone["r0"]
    other_seed = GenerationRequest("x", requests[0].prompt_token_ids, _sampled(7, 20))
    assert frames(make(base).generate([other_seed])["x"]) != alone["r0"]
    # all six together, joining one a step, prompts chunked under a small step budget
    engine = make(base, max_step_tokens=48)
    out: dict[str, list[TokenEvent]] = {r.request_id: [] for r in requests}
    pending = list(requests)
    while pending or engine.has_work():
        if pending:
            engine.add(pending.pop(0))
        for event in engine.step():
            out[event.request_id].append(event)
    for r in requests:
        assert frames(out[r.request_id]) == alone[r.request_id], r.request_id


def test_preemption_and_recompute_change_nothing(base: Engine) -> None:
    """A KV budget too small for all four: the newest is preempted and recomputes prompt and
    frames so far (a prefill of text and audio rows); greedy frames equal each run alone."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)  # all 40 frames
    requests = [
        GenerationRequest(f"r{i}", prompt(base, t), params) for i, t in enumerate(TEXTS[:4])
    ]
    alone = {r.request_id: frames(make(base).generate([r])[r.request_id]) for r in requests}
    engine = make(base, max_total_tokens=384, max_step_tokens=64)
    out = engine.generate(requests)
    assert engine.batcher.num_preemptions > 0
    for r in requests:
        assert frames(out[r.request_id]) == alone[r.request_id], r.request_id


def test_abort_mid_generation_frees_its_blocks(base: Engine) -> None:
    engine = make(base)
    allocator = engine.cache.allocator
    free_before = allocator.num_free
    keep = GenerationRequest("keep", prompt(base, TEXTS[0]), greedy(30))
    drop = GenerationRequest(
        "drop", prompt(base, TEXTS[1]), SamplingParams(max_tokens=200, ignore_eos=True, seed=1)
    )
    engine.add(keep)
    engine.add(drop)
    events: dict[str, list[TokenEvent]] = {"keep": [], "drop": []}
    for _ in range(6):
        for event in engine.step():
            events[event.request_id].append(event)
    assert len(frames(events["drop"])) >= 4 and not events["drop"][-1].finished
    held = allocator.num_free
    assert engine.abort("drop")
    assert allocator.num_free > held  # at once, before the next step
    while engine.has_work():
        for event in engine.step():
            events[event.request_id].append(event)
    assert events["drop"][-1].finish_reason is FinishReason.ABORT
    assert allocator.num_free == free_before
    assert frames(events["keep"]) == frames(make(base).generate([keep])["keep"])


def test_bad_audio_requests_are_refused(base: Engine) -> None:
    engine = make(base)
    ids = prompt(base, TEXTS[0])
    audio = base.model.audio
    assert audio is not None
    with pytest.raises(ValueError, match="0 audio frame token"):
        engine.add(GenerationRequest("a", ids, greedy(), audio_codes=[[0] * 8]))
    with pytest.raises(ValueError, match="8 integer codes"):
        with_frame = [*ids[:-1], audio.audio_token_id, ids[-1]]
        engine.add(GenerationRequest("b", with_frame, greedy(), audio_codes=[[0] * 7]))
    with pytest.raises(ValueError, match="stop strings"):
        engine.add(GenerationRequest("c", ids, SamplingParams(stop=("x",))))
    with pytest.raises(ValueError, match="set together"):
        SamplingParams(ras_window=7)
    assert not engine.has_work()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_frames_through_cuda_graphs_equal_eager_on_gpu(higgs_dir: Path, base: Engine) -> None:
    """Decode steps replay captured graphs (the audio path with a static frame buffer): seeded
    frames equal the eager GPU run, and greedy float32 frames equal the CPU engine's."""
    requests = [
        GenerationRequest(f"r{i}", prompt(base, t), _sampled(i, 24)) for i, t in enumerate(TEXTS)
    ]
    greedy_request = GenerationRequest("g", prompt(base, TEXTS[0]), greedy())

    def run(cuda_graphs: bool) -> dict[str, list[list[int]]]:
        config = EngineConfig(
            max_total_tokens=4096, max_batch_size=8, device="cuda", cuda_graphs=cuda_graphs
        )
        engine = Engine.from_checkpoint(higgs_dir, config)
        out = engine.generate([*requests, greedy_request])
        if cuda_graphs:
            assert engine.runner.graphs is not None and engine.runner.graphs.graphs
        return {rid: frames(events) for rid, events in out.items()}

    graphed = run(cuda_graphs=True)
    assert graphed == run(cuda_graphs=False)
    assert graphed["g"] == frames(make(base).generate([greedy_request])["g"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_seeded_ras_frames_from_draw_graphs_are_batch_independent_on_gpu(
    higgs_dir: Path, base: Engine
) -> None:
    """The frame draws replayed from graphs (draw_graphs.py: delay masks, filters, RAS): seeded
    frames with repetition-aware sampling are each request's alone, in a batch of six joining
    one a step, and equal the eager draws (cuda_graphs off)."""

    def params(i: int) -> SamplingParams:
        return SamplingParams(
            temperature=1.0, top_k=40, top_p=0.9, seed=50 + i, max_tokens=30,
            ras_window=7, ras_max_repeat=2,
        )  # fmt: skip

    requests = [GenerationRequest(f"r{i}", prompt(base, t), params(i)) for i, t in enumerate(TEXTS)]

    def engine(cuda_graphs: bool) -> Engine:
        config = EngineConfig(
            max_total_tokens=4096, max_batch_size=8, device="cuda", cuda_graphs=cuda_graphs
        )
        return Engine.from_checkpoint(higgs_dir, config)

    graphed = engine(cuda_graphs=True)
    graphed.warmup()  # every bucket of the served variants captured (RAS over 7 frames)
    head_graphs = graphed.head.graphs
    assert head_graphs is not None
    captured = set(head_graphs.graphs)
    out: dict[str, list[TokenEvent]] = {r.request_id: [] for r in requests}
    pending = list(requests)
    while pending or graphed.has_work():
        if pending:
            graphed.add(pending.pop(0))
        for event in graphed.step():
            out[event.request_id].append(event)
    assert set(head_graphs.graphs) == captured  # serving captured nothing
    alone_engine = engine(cuda_graphs=True)
    eager = engine(cuda_graphs=False).generate(requests)
    for r in requests:
        alone = frames(alone_engine.generate([r])[r.request_id])
        assert frames(out[r.request_id]) == alone, r.request_id
        assert frames(eager[r.request_id]) == alone, r.request_id


def _first_repeat(history: list[list[int]], window: int, most: int, special: set[int]) -> int:
    """The first frame index whose code in some codebook already appears `most` times in that
    codebook over the `window` frames before it (BOS / EOS codes aside), or len(history)."""
    for t, frame in enumerate(history):
        recent = history[max(0, t - window) : t]
        for j, code in enumerate(frame):
            if code not in special and sum(f[j] == code for f in recent) >= most:
                return t
    return len(history)


def test_repetition_aware_sampling_redraws_only_repeats(base: Engine) -> None:
    """The reference's rule (ras_win_len 7, ras_win_max_num_repeat 2, as the published
    generation_config.json): greedy frames are untouched until the first frame that repeats a
    code twice in the last 7 frames; from there the code is redrawn, seeded and reproducibly."""
    audio = base.model.audio
    assert audio is not None
    special = {audio.stream_bos_id, audio.stream_eos_id}
    for text in TEXTS:  # the first prompt whose greedy frames repeat a code
        ids = prompt(base, text)
        plain = frames(make(base).generate([GenerationRequest("p", ids, greedy())])["p"])
        t = _first_repeat(plain, 7, 2, special)
        if t < len(plain):
            break
    assert t < len(plain), "greedy never repeated: the rule went untested"
    ras = SamplingParams(
        temperature=0, max_tokens=MAX_FRAMES, seed=9, ras_window=7, ras_max_repeat=2
    )
    redrawn = frames(make(base).generate([GenerationRequest("r", ids, ras)])["r"])
    assert redrawn[:t] == plain[:t]
    assert redrawn != plain
    again = frames(make(base).generate([GenerationRequest("r", ids, ras)])["r"])
    assert again == redrawn
    # in a batch beside other requests, joining late
    engine = make(base, max_step_tokens=48)
    others = [
        GenerationRequest(f"o{i}", prompt(base, x), _sampled(i, 30))
        for i, x in enumerate(TEXTS[:3])
    ]
    out = engine.generate([*others, GenerationRequest("r", ids, ras)])
    assert frames(out["r"]) == redrawn


def test_workspace_profile_runs_the_audio_path(base: Engine) -> None:
    """The KV budget's profile forwards (workspace.py) drive an audio model through its mixed
    audio + text path and frame sampling (on the CPU they run, measuring 0 bytes)."""
    from omni_server.engine.workspace import measure_workspace

    config = EngineConfig(max_total_tokens=1024, max_batch_size=4, max_step_tokens=64)
    workspace = measure_workspace(base.model, config, max_seq_len=256)
    assert (workspace.mixed, workspace.prefill, workspace.decode) == (0, 0, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kv_cache_sized_from_a_fraction_on_gpu(higgs_dir: Path, base: Engine) -> None:
    """The cache sized from a GPU fraction, the profile running the audio path with its graphs;
    greedy frames still equal the CPU engine's."""
    config = EngineConfig(
        device="cuda", gpu_memory_fraction=0.02, max_batch_size=8, max_seq_len=512
    )
    engine = Engine.from_checkpoint(higgs_dir, config)
    assert engine.memory is not None and engine.cache.capacity_tokens > 512
    request = GenerationRequest("g", prompt(base, TEXTS[1]), greedy())
    assert frames(engine.generate([request])["g"]) == frames(make(base).generate([request])["g"])


FRAME_S = 0.04  # 25 frames a second
STEP_S = 0.01  # the injected clock advances this much a step: frames at 4x real time


class SteppedClock:
    """The engine's clock, moved by the test (STEP_S a step): leads without wall time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _stream(name: str, text: str, base: Engine, frames: int, seed: int, media: bool = True):  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=frames, ignore_eos=True)
    seconds = FRAME_S if media else None
    return GenerationRequest(name, prompt(base, text), params, playback_seconds=seconds)


def _run(engine: Engine, clock: SteppedClock, late: GenerationRequest, join_at: int):  # type: ignore[no-untyped-def]
    """Step until done, adding `late` at step `join_at`: (frames, times) per request."""
    out: dict[str, list[list[int]]] = {}
    times: dict[str, list[float]] = {}
    step = 0
    while engine.has_work() or step <= join_at:
        if step == join_at:
            engine.add(late)
        clock.now += STEP_S
        for event in engine.step():
            out.setdefault(event.request_id, []).extend(event.audio_frames)
            times.setdefault(event.request_id, []).append(clock.now)
        step += 1
    return out, times


def test_a_new_requests_first_frame_does_not_wait_behind_streams_far_ahead(base: Engine) -> None:
    """A full batch (2 rows, 2 streams seconds ahead of their listeners): a third request's
    first frame comes at once instead of when a stream ends, every stream still gets each frame
    before its listener needs it, every request gets all its frames, and seeded frames are
    those of the request alone (sitting a step out changes nothing but when it runs)."""
    texts = TEXTS[:3]

    def serve(media: bool) -> tuple[dict[str, list[list[int]]], dict[str, list[float]], int]:
        engine = make(base, max_batch_size=2, max_step_tokens=256)
        clock = SteppedClock()
        engine.clock = clock
        for i in range(2):
            engine.add(_stream(f"s{i}", texts[i], base, 160, seed=i, media=media))
        late = _stream("late", texts[2], base, 60, seed=7, media=media)
        out, times = _run(engine, clock, late, join_at=60)  # the streams are ~1.6 s ahead
        return out, times, round((times["late"][0] - times["s0"][0]) / STEP_S)

    out, times, late_first = serve(media=True)
    plain_out, _, plain_first = serve(media=False)
    assert late_first <= 62  # joined at step 60: its prefill and first frame in the next steps
    assert plain_first > 150  # the plain order: it waited for a running stream to end
    for name, expected in (("s0", 160), ("s1", 160), ("late", 60)):
        assert len(out[name]) == expected, name  # none starved
        first = times[name][0]
        for k, at in enumerate(times[name][1:], start=1):
            # frame k+1 is due when the listener has played the k before it
            assert at <= first + k * FRAME_S + 1e-9, (name, k)
        assert out[name] == plain_out[name], name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_audio_layers_deferred_adds_equal_plain_on_gpu(higgs_dir: Path) -> None:
    """bf16 on CUDA the layers run with each residual add done by the next norm
    (forward_deferred): on a decode step's audio-only rows (the audio norms and MLP) and on
    text rows, two DualFFN layers give the plain layers' residual stream to the last bit."""
    from omni_server.engine.attention import DecodeGroup, ForwardBatch
    from omni_server.engine.families.higgs_audio_v2.head import FrameInputs
    from omni_server.engine.families.higgs_audio_v2.model import DualFFNLayer

    config = EngineConfig(max_total_tokens=1024, device="cuda", dtype="bfloat16")
    model = Engine.from_checkpoint(higgs_dir, config).model
    layers = [layer for layer in model.layers if isinstance(layer, DualFFNLayer)][:2]
    assert len(layers) == 2 and model.audio is not None
    shape, b = model.local_shape, 2
    gen = torch.Generator().manual_seed(4)
    h0 = torch.randn(b, shape.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    caches = [
        torch.randn(64, shape.num_kv_heads, shape.head_dim, generator=gen).to(
            "cuda", torch.bfloat16
        )
        for _ in range(4)
    ]
    codes = torch.zeros(b, model.audio.num_codebooks, dtype=torch.int64, device="cuda")
    for audio_codes in (codes, None):
        batch = ForwardBatch(
            input_ids=torch.zeros(b, dtype=torch.int64, device="cuda"),
            positions=torch.tensor([3, 18], device="cuda"),
            slot_mapping=torch.tensor([19, 50], device="cuda"),  # distinct: no write race
            logits_indices=torch.arange(b, device="cuda"),
            decode=DecodeGroup(
                b,
                block_tables=torch.tensor([[1, 0], [2, 3]], dtype=torch.int32, device="cuda"),
                context_lens=torch.tensor([4, 19], dtype=torch.int32, device="cuda"),
                block_size=16,
            ),
            prefills=[],
            family_inputs=None if audio_codes is None else FrameInputs(audio_codes),
        )
        rope = model.rope_rows(batch.positions)
        plain, deferred, delta = h0, h0, None
        with torch.inference_mode():
            for i, layer in enumerate(layers):
                k, v = caches[2 * i], caches[2 * i + 1]
                plain = layer(plain, rope, k, v, batch)
                deferred, delta = layer.forward_deferred(deferred, delta, rope, k, v, batch)
        assert delta is not None
        assert torch.equal(deferred + delta, plain), audio_codes is None
