"""examples/qwen3-omni's thinker half served through the runtime's real processes
(preprocessing and audio_encoder in `frontend`, the thinker on the engine in `thinker`), on
tiny random checkpoints (`omni-bench random-checkpoint qwen3-omni --size tiny`, the thinker's
norm weights redrawn around 1) for the seeds in SEEDS, against transformers'
`Qwen3OmniMoeForConditionalGeneration` in this process (the oracle only):

- greedy: the ids the thinker streams equal `generate(..., return_audio=False,
  do_sample=False)` for a text prompt and for an audio prompt (a 16 kHz WAV clip the served
  side decodes, resamples and hears through its own mel and audio tower; the reference gets the
  same samples through WhisperFeatureExtractor and its own tower), NEW_TOKENS (48) each, on
  every seed; the prompt ids equal the reference processor's (the tokenizer's chat template,
  the placeholder expanded), the caller's text is the ids' text;
- the TalkerOpening's multimodal_hidden equals the reference thinker's
  `hidden_states[accept_hidden_layer]` at the audio placeholders (atol 1e-4, rtol 1e-4: fp32);
  the talker gets the opening with the first ids and the ids as they come, the last chunk
  done; a text-only chat feeds it nothing; the caller's chunks carry text only;
- 8 concurrent conversations of different lengths (text and audio, sampled with seeds) each
  equal their run alone, and again;
- a prompt over the context, a max_tokens over it, a clip that is no audio, a clip too short:
  400s naming the part; the stages go on serving.

Stand-in, labelled: the talker stage (another branch's) is a probe here, `talker/` below: a
stream stage that records what the thinker streams to it and returns it as its result. Serving
needs no transformers: every stage process starts under the Higgs tests' import blocker.
"""

from __future__ import annotations

import asyncio
import io
import shutil
import wave
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import torch

from omni_server.contracts import AudioPart, ChatInput, Message, Sampling, SpeechOptions
from omni_server.models.qwen3_omni.audio_encoder import output_lengths
from omni_server.pipeline import PipelineError
from tests.examples.test_higgs_audio_v2 import BLOCKER, blocked_pids, python_path
from tests.helpers.server import ROOT
from tests.models.qwen3_omni.test_audio import clip

transformers = pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.asyncio(loop_scope="module"),  # one runtime per seed lives on the module's loop
]

EXAMPLE = ROOT / "examples" / "qwen3-omni"
MODEL = "qwen3-omni"
SEEDS = (0, 1)
NEW_TOKENS = 48
TEXT = "The sun rises in the east. Tell me, in a few words, why the sky is blue at noon."
QUESTION = "What is in this audio clip?"
VOICE = SpeechOptions("ethan", response_format="pcm")

PROBE = '''\
"""Test probe standing in for the talker stage (another branch's): records what the thinker
streams into it and returns that as its result."""

from omni_server.backend import StageBackend
from omni_server.models.qwen3_omni.handoff import TalkerOpening, ThinkerTokens


class TalkerProbe(StageBackend):
    def generate(self, request):
        yield from ()
        opening, tokens, dones, tokens_before_opening = None, [], [], 0
        for chunk in request.stream():
            if TalkerOpening.KEY in chunk:
                got = chunk[TalkerOpening.KEY]
                assert isinstance(got, TalkerOpening) and opening is None
                opening = {"prompt_ids": list(got.prompt_ids), "voice": got.speech.voice,
                           "hidden": got.multimodal_hidden.clone()}
            if ThinkerTokens.KEY in chunk:
                got = chunk[ThinkerTokens.KEY]
                assert isinstance(got, ThinkerTokens)
                tokens_before_opening += opening is None
                tokens.extend(got.token_ids)
                dones.append(got.done)
        return {"opening": opening, "tokens": tokens, "dones": dones,
                "tokens_before_opening": tokens_before_opening}
'''


@dataclass
class Reference:
    """transformers' answer for one prompt."""

    prompt_ids: list[int]
    tokens: list[int]  # NEW_TOKENS greedy ids
    hidden: torch.Tensor | None = None  # [placeholders, hidden] at accept_hidden_layer


@dataclass
class Seeded:
    seed: int
    folder: Path
    plan: Any
    text: Reference
    audio: Reference
    tokenizer: Any


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return out.getvalue()


def wav_samples(data: bytes) -> np.ndarray:
    """The clip's samples as any decoder reads PCM16 (x / 32768)."""
    with wave.open(io.BytesIO(data)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768


CLIP = wav_bytes(clip(2.73, 5), 16000)


def perturb_norms(folder: Path, seed: int) -> None:
    """Random checkpoints have all-ones norm weights, under which the order of a QK-norm's
    weights could not matter: draw the thinker's around 1 (the reference reads them too)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    for name, value in tensors.items():
        if name.startswith("thinker.model.") and name.endswith("norm.weight"):
            tensors[name] = 1 + 0.5 * torch.randn(value.shape, generator=gen)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module", autouse=True)
def on_the_cpu() -> Iterator[None]:
    """fp32 on the CPU against the fp32 reference (test_qwen3_omni_gpu.py runs the GPU)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def no_transformers(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    folder = tmp_path_factory.mktemp("blocker")
    (folder / "sitecustomize.py").write_text(BLOCKER)
    return [str(folder)]


def repository(root: Path) -> Path:
    """The example's stages (preprocessing, audio_encoder, thinker) and the talker probe."""
    for stage in ("preprocessing", "audio_encoder", "thinker"):
        shutil.copytree(EXAMPLE / stage, root / stage)
    (root / "talker").mkdir()
    (root / "talker" / "model.py").write_text(PROBE)
    (root / "talker" / "stage.toml").write_text(
        'backend = "model.py:TalkerProbe"\nprocess = "talker"\nterminal = true\n'
        '[scheduler]\nkind = "stream"\n'
    )
    (root / "repository.toml").write_text(
        f'[models.{MODEL}]\nentry = "preprocessing"\ntasks = ["chat"]\n'
        'voices = ["ethan"]\ndefault_voice = "ethan"\n'
    )
    return root


def references(folder: Path) -> tuple[Reference, Reference, Any]:
    from transformers import (
        AutoTokenizer,
        Qwen3OmniMoeForConditionalGeneration,
        WhisperFeatureExtractor,
    )

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)

    def ids_of(content: list[dict[str, Any]], placeholders: int = 0) -> list[int]:
        messages = [{"role": "user", "content": content}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if placeholders:  # the processor's expansion
            text = text.replace(tokenizer.audio_token, tokenizer.audio_token * placeholders)
        return [int(i) for i in tokenizer(text)["input_ids"]]

    def generate(ids: list[int], **audio: Any) -> list[int]:
        tensor = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(
                input_ids=tensor, attention_mask=torch.ones_like(tensor), return_audio=False,
                thinker_max_new_tokens=NEW_TOKENS, thinker_do_sample=False, **audio,
            )  # fmt: skip
        return [int(t) for t in out[0, len(ids) :]]

    text_ids = ids_of([{"type": "text", "text": TEXT}])
    text = Reference(text_ids, generate(text_ids))

    extractor = WhisperFeatureExtractor.from_pretrained(folder)
    batch = extractor(
        wav_samples(CLIP), sampling_rate=16000, padding=True, truncation=False,
        return_attention_mask=True, return_tensors="pt",
    )  # fmt: skip
    features, mask = batch["input_features"], batch["attention_mask"]
    frames = int(mask.sum())
    features = features[:, :, :frames]
    mask = mask[:, :frames]
    # the processor's count (tests/models/qwen3_omni/test_processor.py checks it is ours); the
    # reference's thinker refuses a prompt whose placeholders the tower's rows do not fill
    count = int(output_lengths(torch.tensor(frames)))
    audio_ids = ids_of([{"type": "audio", "audio": "clip.wav"}, {"type": "text", "text": QUESTION}],
                       count)  # fmt: skip
    tokens = generate(audio_ids, input_features=features, feature_attention_mask=mask)
    layer = model.config.talker_config.accept_hidden_layer
    with torch.no_grad():
        run = model.thinker(
            input_ids=torch.tensor([audio_ids]), input_features=features,
            feature_attention_mask=mask, output_hidden_states=True,
        )  # fmt: skip
    at = torch.tensor(audio_ids) == tokenizer.audio_token_id
    hidden = run.hidden_states[layer][0, at]
    return text, Reference(audio_ids, tokens, hidden), tokenizer


@pytest.fixture(scope="module", params=SEEDS, ids=lambda seed: f"seed{seed}")
def seeded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Seeded:
    from omni_bench.random_qwen3_omni import write_qwen3_omni
    from omni_server.compiler import compile_repository

    seed = request.param
    folder = write_qwen3_omni(tmp_path_factory.mktemp("qwen3omni") / "ckpt", "tiny", seed=seed)
    perturb_norms(folder, seed)
    text, audio, tokenizer = references(folder)
    root = repository(tmp_path_factory.mktemp("repo"))
    overrides = ["--parameters.checkpoint", str(folder),
                 "--stages.thinker.parameters.ignore_eos", "true"]  # fmt: skip
    return Seeded(seed, folder, compile_repository(root, overrides), text, audio, tokenizer)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runtime(seeded: Seeded, no_transformers: list[str]) -> Any:
    from tests.helpers.runtime import running

    with python_path(no_transformers):
        async with running(seeded.plan) as started:
            yield started


def chat(
    *content: str | AudioPart,
    speech: SpeechOptions | None = VOICE,
    max_tokens: int = NEW_TOKENS,
    temperature: float = 0.0,
    seed: int | None = None,
    stop: tuple[str, ...] = (),
) -> dict[str, Any]:
    parts = content[0] if len(content) == 1 and isinstance(content[0], str) else tuple(content)
    sampling = Sampling(max_tokens=max_tokens, temperature=temperature, seed=seed, stop=stop)
    return ChatInput((Message("user", parts),), sampling, speech).payload()


@dataclass
class Answer:
    text: str  # the caller's deltas, joined
    caller_keys: set[str]  # every key of the thinker's chunks to the caller
    thinker: dict[str, Any]  # the thinker's result
    talker: dict[str, Any]  # what the probe heard


async def ask(runtime: Any, inputs: dict[str, Any]) -> Answer:
    handle = runtime.submit(runtime.plan.models[MODEL], inputs)
    deltas, keys = [], set()
    async for stage, chunk in handle.stream():
        assert stage == "thinker", stage  # the probe streams nothing
        keys |= set(chunk)
        deltas.append(chunk.get("text", ""))
    result = await handle.result()
    return Answer("".join(deltas), keys, result["thinker"], result["talker"])


def check_handoff(answer: Answer, expected: Reference) -> None:
    heard = answer.talker
    assert heard["opening"] is not None and heard["tokens_before_opening"] == 0
    assert heard["opening"]["prompt_ids"] == expected.prompt_ids
    assert heard["opening"]["voice"] == VOICE.voice
    assert heard["dones"][-1] is True and not any(heard["dones"][:-1])
    assert answer.caller_keys == {"text"}  # the talker's contracts never reach the caller


async def test_text_prompt_greedy_equals_transformers(runtime: Any, seeded: Seeded) -> None:
    expected = seeded.text
    assert len(expected.tokens) == NEW_TOKENS and len(set(expected.tokens)) > 8
    spoken = await ask(runtime, chat(TEXT))
    check_handoff(spoken, expected)
    assert spoken.talker["tokens"] == expected.tokens
    assert spoken.talker["opening"]["hidden"].shape[0] == 0  # no multimodal rows
    assert spoken.text == spoken.thinker["text"]
    assert spoken.text == seeded.tokenizer.decode(expected.tokens, skip_special_tokens=True)
    usage = spoken.thinker["usage"]
    assert usage == {"prompt_tokens": len(expected.prompt_ids), "completion_tokens": NEW_TOKENS}
    assert spoken.thinker["finish_reason"] == "length"
    # the same chat without audio out: the same answer, and the talker hears nothing
    written = await ask(runtime, chat(TEXT, speech=None))
    assert written.text == spoken.text and written.caller_keys == {"text"}
    assert written.talker == {"opening": None, "tokens": [], "dones": [],
                              "tokens_before_opening": 0}  # fmt: skip
    # a stop string from the middle of the answer: the text ends before it, finish "stop"
    full = spoken.text
    assert len(full) > 8
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    stopped = await ask(runtime, chat(TEXT, speech=None, stop=(stop,)))
    assert stopped.text == full[: full.find(stop)] == stopped.thinker["text"]
    assert stopped.thinker["finish_reason"] == "stop"


async def test_audio_prompt_greedy_and_talker_hidden_equal_transformers(
    runtime: Any, seeded: Seeded
) -> None:
    expected = seeded.audio
    assert expected.hidden is not None
    assert len(expected.tokens) == NEW_TOKENS and len(set(expected.tokens)) > 8
    spoken = await ask(runtime, chat(AudioPart(CLIP, "wav"), QUESTION))
    check_handoff(spoken, expected)
    assert spoken.talker["tokens"] == expected.tokens
    assert spoken.text == seeded.tokenizer.decode(expected.tokens, skip_special_tokens=True)
    hidden = spoken.talker["opening"]["hidden"]
    assert hidden.shape == expected.hidden.shape and hidden.shape[0] > 30  # 2.73 s: 36 rows
    torch.testing.assert_close(hidden, expected.hidden, atol=1e-4, rtol=1e-4)
    assert expected.tokens != seeded.text.tokens  # the clip is heard


async def test_concurrent_conversations_equal_their_runs_alone(
    runtime: Any, seeded: Seeded
) -> None:
    if seeded.seed != SEEDS[0]:
        pytest.skip("one seed is enough: this is about batching, not the weights")
    clips = [AudioPart(wav_bytes(clip(s, i), rate), "wav")
             for i, (s, rate) in enumerate([(0.8, 24000), (1.9, 16000), (3.3, 22050)])]  # fmt: skip
    conversations = [
        chat(*([clips[i % 3]] if i % 2 else []), TEXT[: 20 + 9 * i],
             max_tokens=8 + 5 * i, temperature=1.0, seed=100 + i)
        for i in range(8)
    ]  # fmt: skip
    alone = [await ask(runtime, c) for c in conversations]
    together = await asyncio.gather(*(ask(runtime, c) for c in conversations))
    again = await ask(runtime, conversations[3])
    for i, (one, many) in enumerate(zip(alone, together, strict=True)):
        assert one.talker["tokens"] == many.talker["tokens"], i
        assert one.text == many.text, i
        assert len(one.talker["tokens"]) == 8 + 5 * i  # ignore_eos: max_tokens each
    assert again.talker["tokens"] == alone[3].talker["tokens"]
    assert len({tuple(a.talker["tokens"]) for a in alone}) == 8


async def test_bad_requests_are_400s_naming_the_part(runtime: Any, seeded: Seeded) -> None:
    cases = [
        (chat("word " * 3000), "context_length_exceeded", "messages"),
        (chat(TEXT, max_tokens=4000), "context_length_exceeded", "messages"),
        (chat(TEXT, AudioPart(b"RIFF, but no audio at all", "wav")), None,
         "messages[0].content[1]"),
        (chat(AudioPart(wav_bytes(np.zeros(50, np.float32), 16000), "wav")), None,
         "messages[0].content[0]"),
    ]  # fmt: skip
    for inputs, code, param in cases:
        with pytest.raises(PipelineError) as err:
            await ask(runtime, inputs)
        assert err.value.code == "invalid_request", err.value
        assert err.value.error_code == code and err.value.param == param, err.value
    after = await ask(runtime, chat(TEXT, max_tokens=4))  # the stages go on serving
    assert len(after.talker["tokens"]) == 4


async def test_stage_processes_serve_without_transformers(
    runtime: Any, no_transformers: list[str]
) -> None:
    pids = set(runtime.processes().values())
    assert len(pids) == 3  # frontend, thinker, talker
    assert pids <= blocked_pids(no_transformers)


async def test_the_example_compiles_with_its_two_models() -> None:
    """The example's own repository.toml: both models, the thinker's stream into the talker
    and on to code2wav, the frontend and thinker processes."""
    from omni_server.compiler import compile_repository

    plan = compile_repository(EXAMPLE, ["--parameters.checkpoint", "/models/qwen3-omni"])
    assert {"qwen3-omni", "qwen3-omni-thinker"} <= set(plan.models)
    assert plan.models["qwen3-omni-thinker"].entry == "preprocessing"
    assert plan.stages["thinker"].stream_to == ("talker",)
    assert plan.stages["talker"].stream_to == ("code2wav",) and plan.stages["code2wav"].terminal
    assert plan.stages["thinker"].terminal and plan.stages["preprocessing"].process == "frontend"
