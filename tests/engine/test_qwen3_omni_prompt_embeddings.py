"""The engine's prompt rows given as embeddings (PromptEmbeddings, the qwen3_omni_moe family's
head): a prompt with audio placeholders, their rows the audio tower's output, on a tiny random
checkpoint, against our plain-torch thinker (models/qwen3_omni/thinker.py, itself equal to
transformers: tests/models/qwen3_omni/test_audio.py) fed the same embeddings:

- greedy ids equal, alone, batched with a text prompt, and with chunked prefill whose chunks
  cut through the placeholder rows; the tapped hidden state (the input of layer
  accept_hidden_layer) at those rows equals the plain thinker's, handed out once, on the first
  event, only when asked for;
- what the head refuses: rows of the wrong width, positions outside the prompt; the text head
  (llama) refuses given rows at all.

The served path against transformers itself: tests/examples/test_qwen3_omni_thinker_served.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_server.engine import (
    Engine,
    EngineConfig,
    GenerationRequest,
    PromptEmbeddings,
    SamplingParams,
    TokenEvent,
)
from omni_server.models.qwen3_omni.audio_encoder import AudioEncoder, output_lengths
from omni_server.models.qwen3_omni.config import Qwen3OmniConfig
from omni_server.models.qwen3_omni.mel import log_mel
from omni_server.models.qwen3_omni.thinker import Thinker, greedy_run
from tests.models.qwen3_omni.test_audio import clip

pytest.importorskip("safetensors")

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@dataclass
class AudioPrompt:
    folder: Path
    ids: list[int]
    positions: tuple[int, ...]
    audio: torch.Tensor  # [M, hidden] the tower's rows
    text_ids: list[int]
    expected: list[int]  # the plain thinker's greedy ids
    hidden: torch.Tensor  # [M, hidden] its layer-tap input at the placeholders
    expected_text: list[int]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompt(tmp_path_factory: pytest.TempPathFactory) -> AudioPrompt:
    from omni_bench.random_qwen3_omni import write_qwen3_omni

    folder = write_qwen3_omni(tmp_path_factory.mktemp("qwen3omni") / "ckpt", "tiny", seed=3)
    config = Qwen3OmniConfig.from_folder(folder)
    features = log_mel(clip(1.7, 3))
    count = int(output_lengths(torch.tensor(features.shape[1])))
    with torch.no_grad():
        audio = AudioEncoder.from_checkpoint(folder)(features, [features.shape[1]])
    # a chat turn's shape: text, <|audio_start|>, the placeholders, <|audio_end|>, text
    head, tail = [11, 23, 5, 61, 7, 9, 2], [8, 42, 77, 13, 4, 99]
    ids = head + [config.audio_token_id] * count + tail
    positions = tuple(range(len(head), len(head) + count))
    thinker, _ = Thinker.from_checkpoint(folder)
    tap = config.talker_ids.accept_hidden_layer
    embeds = thinker.embed(torch.tensor([ids]), config.audio_token_id, audio)
    run = greedy_run(thinker, embeds, NEW_TOKENS, capture_layer=tap)
    assert run.captured is not None
    text_ids = [17, 3, 250, 31, 64, 19, 8, 8, 121, 40, 12]
    text_run = greedy_run(thinker, thinker.embed(torch.tensor([text_ids])), NEW_TOKENS)
    return AudioPrompt(
        folder, ids, positions, audio, text_ids, run.tokens,
        run.captured[0, list(positions)], text_run.tokens,
    )  # fmt: skip


def _engine(folder: Path, **config: int) -> Engine:
    return Engine.from_checkpoint(folder, EngineConfig(max_total_tokens=1024, **config))


def _ids(events: list[TokenEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def _audio_request(prompt: AudioPrompt, keep: bool, name: str = "a") -> GenerationRequest:
    given = PromptEmbeddings(prompt.positions, prompt.audio, keep_hidden=keep)
    return GenerationRequest(name, prompt.ids, GREEDY, prompt_embeddings=given)


def test_given_rows_alone_batched_and_chunked_equal_the_plain_thinker(prompt: AudioPrompt) -> None:
    assert len(set(prompt.expected)) > 8 and prompt.expected != prompt.expected_text
    text = GenerationRequest("t", prompt.text_ids, GREEDY)
    # max_step_tokens 8: the placeholder rows are cut across several prefill chunks
    for config in ({}, {"max_step_tokens": 8, "max_batch_size": 4}):
        engine = _engine(prompt.folder, **config)
        alone = engine.generate([_audio_request(prompt, keep=True)])["a"]
        assert _ids(alone) == prompt.expected, config
        torch.testing.assert_close(alone[0].prompt_hidden, prompt.hidden, atol=1e-5, rtol=1e-5)
        assert all(e.prompt_hidden is None for e in alone[1:])  # handed out once
        both = engine.generate([text, _audio_request(prompt, keep=False)])
        assert _ids(both["a"]) == prompt.expected and _ids(both["t"]) == prompt.expected_text
        assert all(e.prompt_hidden is None for e in both["a"])  # not asked for


def test_preemption_recomputes_the_given_rows(prompt: AudioPrompt) -> None:
    """A KV budget too small for three: the newest is preempted and recomputes its prompt (its
    given rows again) and its ids so far; each equals its run alone, its hidden handed once."""
    base = _engine(prompt.folder)
    config = EngineConfig(max_total_tokens=128, block_size=16, max_step_tokens=32, max_batch_size=4)
    engine = Engine(base.model, config, base.tokenizer)
    names = ["a", "b", "c"]
    assert 3 * (len(prompt.ids) + NEW_TOKENS) > 128  # they cannot all fit at once
    out = engine.generate([_audio_request(prompt, keep=True, name=n) for n in names])
    assert engine.batcher.num_preemptions > 0
    for name in names:
        assert _ids(out[name]) == prompt.expected, name
        handed = [e.prompt_hidden for e in out[name] if e.prompt_hidden is not None]
        assert len(handed) == 1, name
        torch.testing.assert_close(handed[0], prompt.hidden, atol=1e-5, rtol=1e-5)


def test_given_rows_in_mixed_steps_through_the_split_launch(prompt: AudioPrompt) -> None:
    """A text request decoding, then two audio requests prefilled in chunks beside it, the
    decode rows through test_mixed_steps' EagerGraphs (its labelled stand-in for the decode
    graph, which carries no given rows) and the chunks eagerly: each request's ids those of
    its run alone, the hidden state too."""
    from tests.engine.test_mixed_steps import EagerGraphs, mixed, serve

    base = _engine(prompt.folder)
    config = EngineConfig(max_total_tokens=1024, max_batch_size=4, max_step_tokens=16)
    engine = Engine(base.model, config, base.tokenizer)
    engine.runner.graphs = EagerGraphs(engine.runner)  # type: ignore[assignment]
    hidden: list[torch.Tensor] = []
    keep = engine.head.append

    def append(seq: Any, draw: Any) -> TokenEvent:  # the events' hidden states, recorded
        event = keep(seq, draw)
        if event.prompt_hidden is not None:
            hidden.append(event.prompt_hidden)
        return event

    engine.head.append = append  # type: ignore[method-assign]
    text = GenerationRequest("t", prompt.text_ids, GREEDY)
    audio = [_audio_request(prompt, keep=True, name=n) for n in ("a", "b")]
    out, batches = serve(engine, text, audio, join_after=2)
    assert mixed(batches) >= 3
    assert out == {"t": prompt.expected_text, "a": prompt.expected, "b": prompt.expected}
    assert len(hidden) == 2
    for rows in hidden:
        torch.testing.assert_close(rows, prompt.hidden, atol=1e-5, rtol=1e-5)


def test_the_head_refuses_rows_it_cannot_place(prompt: AudioPrompt) -> None:
    engine = _engine(prompt.folder)
    wide = PromptEmbeddings(prompt.positions, torch.zeros(len(prompt.positions), 3))
    with pytest.raises(ValueError, match="wide"):
        engine.add(GenerationRequest("w", prompt.ids, GREEDY, prompt_embeddings=wide))
    outside = PromptEmbeddings((len(prompt.ids),), prompt.audio[:1])
    with pytest.raises(ValueError, match="outside the prompt"):
        engine.add(GenerationRequest("o", prompt.ids, GREEDY, prompt_embeddings=outside))
    with pytest.raises(ValueError, match="ascending"):
        PromptEmbeddings((3, 2), prompt.audio[:2])
    assert not engine.has_work()


def test_a_text_model_refuses_given_rows() -> None:
    from omni_server.engine import SMOLLM2_135M

    shape = dataclasses.replace(SMOLLM2_135M, num_layers=1)
    engine = Engine.from_random(shape, EngineConfig(max_total_tokens=256))
    given = PromptEmbeddings((0,), torch.zeros(1, shape.hidden_size))
    with pytest.raises(ValueError, match="token ids only"):
        engine.add(GenerationRequest("x", [1, 2], GREEDY, prompt_embeddings=given))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_given_rows_on_gpu_equal_the_plain_thinker(prompt: AudioPrompt) -> None:
    """float32 on CUDA (the fused Triton experts where triton is installed), decode steps from
    captured graphs: the same ids and tapped hidden state as the CPU's plain thinker."""
    config = EngineConfig(max_total_tokens=1024, device="cuda", dtype="float32", cuda_graphs=True)
    engine = Engine.from_checkpoint(prompt.folder, config)
    text = GenerationRequest("t", prompt.text_ids, GREEDY)
    events = engine.generate([text, _audio_request(prompt, keep=True)])
    assert _ids(events["a"]) == prompt.expected and _ids(events["t"]) == prompt.expected_text
    hidden = events["a"][0].prompt_hidden
    assert hidden is not None
    torch.testing.assert_close(hidden.cpu(), prompt.hidden, atol=1e-4, rtol=1e-4)
