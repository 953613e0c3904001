"""The talker half of examples/qwen3-omni served (its `talker` and `code2wav` stages), on the
tiny random checkpoints of tests/models/qwen3_omni (seeds 0 and 1, fixtures shared), against
transformers' `Qwen3OmniMoeForConditionalGeneration`:

- greedy: the frames the talker stage sends equal the codes `generate(..., return_audio=True)`
  hands its code2wav, all G groups over FRAMES (48) frames a case (codec EOS suppressed on both
  sides, as tests/models/qwen3_omni/test_talker.py does), with the thinker's tokens arriving
  all at once or late (one every few talker steps: the talker waits, it never hears tts_pad for
  late text); the audio code2wav serves equals transformers' `Qwen3OmniMoeCode2Wav` decode of
  those codes at >= 30 dB SNR, streamed (pcm) and whole (wav);
- 8 concurrent requests of different lengths, greedy and seeded sampling, each equal to its run
  alone; seeded sampling reproducible, another seed differs;
- abort mid-stream: the talker and code2wav drop the request at once (their live request
  counts, the talker's state collected), the other request goes on unchanged;
- an unknown voice is an InvalidRequest naming it and the checkpoint's speakers;
- through the runtime's real processes, where transformers cannot be imported: the audio of
  greedy requests equals the reference's decode of its codes.

The stages are driven directly in most tests (`serve` plays the ar scheduler and the
talker -> code2wav stream); the thinker's chunks come from the plain-torch `Thinker`
(models/qwen3_omni/thinker.py, itself checked against transformers) through the STAND-IN
thinker stage of tests/examples/qwen3_omni_stand_in (labelled: the real thinker stage lands
with examples/qwen3-omni/thinker).
"""

from __future__ import annotations

import gc
import shutil
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_server.audio import decode
from omni_server.backend import InvalidRequest, Request, StageConfigError, StageContext
from omni_server.compiler import compile_repository
from omni_server.contracts import SpeechOptions
from omni_server.models.qwen3_omni.thinker import Thinker
from omni_server.stage.backends import load_backend
from tests.examples.qwen3_omni_stand_in.thinker.model import thinker_chunks
from tests.examples.test_higgs_audio_v2 import (  # noqa: F401
    blocked_pids,
    no_transformers,
    python_path,
)
from tests.helpers.server import ROOT
from tests.models.qwen3_omni.conftest import Checkpoint, checkpoint, one_torch_thread  # noqa: F401
from tests.models.qwen3_omni.test_talker import FRAMES, THINKER_TOKENS, reference_codes

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:Passing `repetition_penalty`:UserWarning"),
]

EXAMPLE = ROOT / "examples" / "qwen3-omni"
STAND_IN = Path(__file__).with_name("qwen3_omni_stand_in")
MODEL = "qwen3-omni-speak"
MIN_SNR_DB = 30.0
SAMPLES_PER_FRAME = 1920
CASES = [("Hello, how are you today?", "Ethan", 1), ("What is in this audio clip?", "Aiden", 3)]
GREEDY = {"ignore_eos": True, "max_audio_seconds": FRAMES / 12.5}


@pytest.fixture(scope="session")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in thinker beside the example's talker and code2wav."""
    folder = tmp_path_factory.mktemp("qwen3-omni-repo") / "repo"
    shutil.copytree(STAND_IN, folder, ignore=shutil.ignore_patterns("__pycache__"))
    for stage in ("talker", "code2wav"):
        shutil.copytree(EXAMPLE / stage, folder / stage, ignore=shutil.ignore_patterns("__pyc*"))
    return folder


def stage(repo: Path, name: str, folder: Path, device: str = "cpu", **parameters: Any) -> Any:
    """The repository's stage `name`, initialized on `device` with `parameters` overridden."""
    spec = compile_repository(repo, ["--parameters.checkpoint", str(folder)]).stages[name]
    backend = load_backend(spec)
    backend.initialize(
        StageContext(
            stage=name,
            parameters={**spec.parameters, **parameters},
            device=device,
            repository=repo,
            stage_dir=spec.directory,
            repository_parameters={"checkpoint": str(folder)},
        )
    )
    return backend


@dataclass
class Stages:
    talker: Any
    code2wav: Any
    thinker: Thinker
    config: Any
    tokenizer: Any


@pytest.fixture(scope="module")
def stages(checkpoint: Checkpoint, repo: Path) -> Stages:  # noqa: F811
    thinker, config = Thinker.from_checkpoint(checkpoint.folder)
    return Stages(
        stage(repo, "talker", checkpoint.folder, **GREEDY),
        stage(repo, "code2wav", checkpoint.folder),
        thinker,
        config,
        checkpoint.tokenizer,
    )


def prompt_ids(stages: Stages, text: str) -> list[int]:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": text}]},
    ]
    ids = stages.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    return [int(i) for i in ids[0]]


@dataclass(eq=False)
class Talk:
    """One request as the runtime would carry it: the thinker's chunks into the talker (one
    more every `every` steps from step `start`), the talker's chunks into code2wav."""

    name: str
    thinker: list[dict[str, Any]]
    start: int = 0
    every: int = 1
    sent: int = 0
    frames: list[list[int]] = field(default_factory=list)
    to_code2wav: list[dict[str, Any]] = field(default_factory=list)
    talker_done: bool = False
    audio: bytearray = field(default_factory=bytearray)
    result: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.at_talker = Request(self.name, {}, _take=self._thinker_chunks)
        self.at_code2wav = Request(self.name, {}, _take=self._talker_chunks)
        self._due = 0

    def arrive(self, step: int) -> None:
        if step >= self.start and (step - self.start) % self.every == 0:
            self._due = min(len(self.thinker), self._due + 1)

    def _thinker_chunks(self) -> tuple[list[dict[str, Any]], bool]:
        taken = self.thinker[self.sent : self._due]
        self.sent = self._due
        return taken, self.sent == len(self.thinker)

    def _talker_chunks(self) -> tuple[list[dict[str, Any]], bool]:
        taken, self.to_code2wav = self.to_code2wav, []
        return taken, self.talker_done


def serve(stages: Stages, talks: list[Talk], steps: int = 3000, to_the_end: bool = True) -> None:
    """Step both stages as their ar schedulers would, every talk to its end (or `steps`)."""
    talker, code2wav = stages.talker, stages.code2wav
    for step in range(steps):
        for talk in talks:
            talk.arrive(step)
            if step == talk.start:
                talker.add(talk.at_talker)
        for output in talker.step():
            talk = next(t for t in talks if t.at_talker is output.request)
            assert output.error is None, output.error
            # code2wav holds a request from its first chunk, or from its stream's end
            if not (talk.frames or talk.to_code2wav or talk.talker_done):
                code2wav.add(talk.at_code2wav)
            if output.chunk is not None:
                talk.frames += output.chunk["frames"]
                talk.to_code2wav.append(output.chunk)
            talk.talker_done |= output.finished
        for output in code2wav.step():
            talk = next(t for t in talks if t.at_code2wav is output.request)
            assert output.error is None, output.error
            if output.chunk is not None:
                talk.audio += output.chunk["audio"]
            if output.finished:
                talk.result = output.result
        if all(t.result is not None or t.at_talker.aborted for t in talks):
            return
    if to_the_end:
        raise AssertionError("requests did not end")


def talk(stages: Stages, text: str, voice: str, *, every: int = 1, start: int = 0,
         tokens: int = THINKER_TOKENS, **speech: Any) -> Talk:  # fmt: skip
    options = SpeechOptions(voice, **{"response_format": "pcm", "temperature": 0.0, **speech})
    chunks = thinker_chunks(stages.thinker, stages.config, prompt_ids(stages, text), options,
                            tokens)  # fmt: skip
    return Talk(f"{text[:12]}-{voice}-{start}", chunks, start, every)


def snr_db(reference: np.ndarray, served: np.ndarray) -> float:
    assert len(served) == len(reference), (len(served), len(reference))
    noise = float(np.sum((reference - served) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(float(np.sum(reference**2)) / noise)


@pytest.fixture(scope="module")
def references(checkpoint: Checkpoint, stages: Stages) -> list[torch.Tensor]:  # noqa: F811
    """transformers' codes [G, FRAMES] for each of CASES."""
    eos = [stages.config.im_end_token_id]
    out = []
    for text, voice, _ in CASES:
        ids = torch.tensor([prompt_ids(stages, text)])
        _, codes = reference_codes(checkpoint, ids, eos, voice)
        out.append(codes)
    return out


def test_greedy_frames_then_audio_equal_transformers(
    checkpoint: Checkpoint,  # noqa: F811
    stages: Stages,
    references: list[torch.Tensor],
    record_property: Any,
) -> None:
    """Frames equal the reference's codes (the second case's thinker text arrives one token
    every 3 talker steps); the streamed pcm and the whole wav equal its code2wav's decode."""
    compared: list[int] = []
    snrs: list[float] = []
    for (text, voice, every), expected in zip(CASES, references, strict=True):
        streamed = talk(stages, text, voice, every=every)
        whole = talk(stages, text, voice, every=every, response_format="wav", stream=False)
        serve(stages, [streamed])
        serve(stages, [whole])
        got = torch.tensor(streamed.frames).T
        assert expected.shape == (stages.config.talker_ids.num_code_groups, FRAMES)
        assert torch.equal(got, expected), (text, voice)
        compared.append(got.shape[1])
        assert streamed.result is not None and streamed.result["frames"] == FRAMES
        assert streamed.result["finish_reason"] == "length"
        with torch.no_grad():
            want = checkpoint.reference.code2wav(expected[None])[0, 0].numpy()
        assert FRAMES * SAMPLES_PER_FRAME - len(want) < SAMPLES_PER_FRAME
        pcm = decode(bytes(streamed.audio), "pcm").samples
        wav = decode(bytes(whole.audio), "wav").samples
        snrs += [round(float(snr_db(want, pcm)), 1), round(float(snr_db(want, wav)), 1)]
        assert min(snrs[-2:]) >= MIN_SNR_DB
    record_property("frames_compared", compared)
    record_property("snr_db", snrs)
    print(f"frames compared: {compared}; SNR (pcm, wav) against the reference's decode: {snrs}")
    assert min(compared) >= 48


def test_concurrent_requests_equal_their_run_alone_and_sampling_is_seeded(
    stages: Stages,
) -> None:
    """8 requests of different prompts, thinker lengths, start steps and text arrival rates,
    half greedy and half sampled with their own seeds: each one's frames and audio equal its
    run alone; a sampled one again is the same, with another seed not."""

    def requests() -> list[Talk]:
        texts = ["Hi.", "Tell me a story about a dragon.", "What time is it?", "Good morning!"]
        voices = ["Ethan", "Aiden", "Chelsie"]
        return [
            talk(stages, texts[i % 4], voices[i % 3], start=3 * i, every=1 + i % 3,
                 tokens=3 + i, temperature=0.0 if i % 2 else 0.9, seed=100 + i)
            for i in range(8)
        ]  # fmt: skip

    alone = []
    for request in requests():
        serve(stages, [request])
        alone.append(request)
    together = requests()
    serve(stages, together)
    for one, other in zip(alone, together, strict=True):
        assert other.frames == one.frames, one.name
        # code2wav decoded it in a batch of windows: the same samples up to fp32 rounding
        # (an s16 step here and there)
        ours, theirs = (decode(bytes(t.audio), "pcm").samples for t in (other, one))
        assert snr_db(theirs, ours) >= 60.0, one.name
    assert len({len(t.thinker) for t in alone}) > 4  # the thinker's lengths differ
    again = requests()[0]
    serve(stages, [again])
    assert again.frames == alone[0].frames
    reseeded = talk(stages, "Hi.", "Ethan", tokens=3, temperature=0.9, seed=7)
    serve(stages, [reseeded])
    assert reseeded.frames != alone[0].frames
    assert stages.talker.live_requests == 0 and stages.code2wav.live_requests == 0


def test_abort_mid_stream_frees_the_talker_and_stops_code2wav(stages: Stages) -> None:
    talker, code2wav = stages.talker, stages.code2wav
    alone = talk(stages, "Hello, how are you today?", "Ethan")
    serve(stages, [alone])
    kept = talk(stages, "Hello, how are you today?", "Ethan")
    gone = talk(stages, "What time is it?", "Aiden", every=2)
    serve(stages, [kept, gone], steps=20, to_the_end=False)  # both speak, audio decoded
    assert gone.audio and len(gone.frames) < FRAMES
    assert talker.live_requests == 2 and code2wav.live_requests == 2
    state = weakref.ref(talker.state(gone.at_talker))
    # the runtime's abort: the request marked, then every stage holding it told
    for request, held_by in ((gone.at_talker, talker), (gone.at_code2wav, code2wav)):
        request.abort()
        held_by.abort(request)
    assert talker.live_requests == 1 and code2wav.live_requests == 1
    assert talker.state(gone.at_talker) is None
    gc.collect()
    assert state() is None  # its KV cache and logits went with it
    kept.start = -1  # held by both stages already: it goes on where it was
    serve(stages, [kept])
    assert kept.frames == alone.frames
    kept_audio, alone_audio = (decode(bytes(t.audio), "pcm").samples for t in (kept, alone))
    assert snr_db(alone_audio, kept_audio) >= 60.0
    assert talker.live_requests == 0 and code2wav.live_requests == 0


def test_the_engine_batches_talker_rows_and_frees_every_block(stages: Stages) -> None:
    """The talker stage's engine: a step holds several requests' talker rows (read off its
    batcher's batches), and after an abort mid-stream and the others' ends every KV block is
    free again."""
    engine = stages.talker.engine
    allocator = engine.cache.allocator
    full = allocator.num_free
    rows: list[int] = []
    next_batch = engine.batcher.next_batch

    def spy(*args: Any, **kwargs: Any) -> Any:  # the real batcher's batch, its decodes noted
        batch = next_batch(*args, **kwargs)
        if batch is not None:
            rows.append(len(batch.decodes))
        return batch

    talks = [talk(stages, "Hello, how are you today?", v, start=i)
             for i, v in enumerate(["Ethan", "Aiden", "Chelsie"])]  # fmt: skip
    gone = talk(stages, "What time is it?", "Aiden")
    engine.batcher.next_batch = spy
    try:
        serve(stages, [*talks, gone], steps=12, to_the_end=False)
        assert allocator.num_free < full and len(gone.frames) < FRAMES
        for request, held_by in ((gone.at_talker, stages.talker),
                                 (gone.at_code2wav, stages.code2wav)):  # fmt: skip
            request.abort()
            held_by.abort(request)
        for t in talks:
            t.start = -1  # held by both stages already
        serve(stages, talks)
    finally:
        del engine.batcher.next_batch
    assert max(rows) == 4  # every request's talker row in one step
    assert allocator.num_free == full
    assert stages.talker.live_requests == 0 and stages.code2wav.live_requests == 0


def test_an_unknown_voice_names_the_speakers(stages: Stages) -> None:
    bad = talk(stages, "Hi.", "nobody")
    stages.talker.add(bad.at_talker)
    bad.arrive(0)
    (output,) = stages.talker.step()
    assert isinstance(output.error, InvalidRequest)
    assert output.error.param == "voice"
    assert "'nobody'" in str(output.error) and "aiden, chelsie, ethan" in str(output.error)
    assert stages.talker.live_requests == 0


@pytest.mark.parametrize("name", ["thinker", "talker"])
@pytest.mark.parametrize("value", [-1, "2048", True])
def test_warm_graphs_tokens_must_be_a_count(
    checkpoint: Checkpoint,  # noqa: F811
    repo: Path,
    name: str,
    value: Any,
) -> None:
    """The stages' start-up capture bound (warm_graphs_tokens) refuses what is not a count,
    naming the field, before any weight is read."""
    folder = EXAMPLE if name == "thinker" else repo
    with pytest.raises(
        StageConfigError, match=r"parameters\.warm_graphs_tokens must be an integer >= 0"
    ):
        stage(folder, name, checkpoint.folder, warm_graphs_tokens=value)


def test_a_thinker_that_says_nothing_ends_both_stages_silently(stages: Stages) -> None:
    """The thinker ended before its first id (handoff.py: it then sends the talker nothing)."""
    silent = Talk("silent", [])
    serve(stages, [silent])
    assert silent.frames == [] and silent.audio == b""
    assert silent.result is not None and silent.result["finish_reason"] == "silent"
    assert stages.talker.live_requests == 0 and stages.code2wav.live_requests == 0


# ---- through the runtime's processes ---------------------------------------------------------


@pytest.fixture(scope="module")
def plan(checkpoint: Checkpoint, repo: Path) -> Iterator[Any]:  # noqa: F811
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        overrides = ["--parameters.checkpoint", str(checkpoint.folder)]
        for key, value in GREEDY.items():
            overrides += [f"--stages.talker.parameters.{key}", str(value).lower()]
        yield compile_repository(repo, overrides)


async def test_served_audio_through_processes_equals_the_reference(
    plan: Any,
    stages: Stages,
    references: list[torch.Tensor],
    checkpoint: Checkpoint,  # noqa: F811
    no_transformers: list[str],  # noqa: F811
) -> None:
    from tests.helpers.runtime import running

    model = plan.models[MODEL]
    with python_path(no_transformers):
        async with running(plan) as runtime:
            pids = set(runtime.processes().values())
            bodies = []
            for text, voice, _ in CASES:
                fields = {
                    "prompt_ids": prompt_ids(stages, text),
                    "speech": SpeechOptions(voice, response_format="pcm", temperature=0.0),
                }
                body = bytearray()
                async with runtime.submit(model, fields) as handle:
                    async for chunk in handle:
                        body += chunk["audio"]
                    await handle.result()
                bodies.append(bytes(body))
    assert pids and pids <= blocked_pids(no_transformers)  # none of them could use transformers
    for body, expected in zip(bodies, references, strict=True):
        with torch.no_grad():
            want = checkpoint.reference.code2wav(expected[None])[0, 0].numpy()
        assert snr_db(want, decode(body, "pcm").samples) >= MIN_SNR_DB


def test_abort_over_http_stops_the_talker_and_code2wav(
    checkpoint: Checkpoint,  # noqa: F811
    repo: Path,
    no_transformers: list[str],  # noqa: F811
    tmp_path: Path,
) -> None:
    """omni-server on the test repository; a caller that leaves after its first audio bytes
    (the talker would speak 120 s): both stages drop the request at once (their logs count
    the requests still running: none), and the server still answers."""
    import http.client
    import json
    import time

    from tests.helpers.server import ServerProcess

    with pytest.MonkeyPatch.context() as patch, python_path(no_transformers):
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        server = ServerProcess.start(
            repo, tmp_path / "server.log", "--parameters.checkpoint", str(checkpoint.folder),
            "--stages.talker.parameters.ignore_eos", "true",
        )  # fmt: skip
    with server:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        body = {"model": MODEL, "voice": "ethan", "input": "Hello, how are you today?",
                "response_format": "pcm"}  # fmt: skip
        connection.request("POST", "/v1/audio/speech", json.dumps(body),
                           {"Content-Type": "application/json"})  # fmt: skip
        response = connection.getresponse()
        assert response.status == 200
        assert response.read1(4096)
        connection.close()  # mid-stream: 1500 frames to go
        deadline = time.monotonic() + 60
        stopped = ("talker: aborted", "code2wav: stopped")  # two processes: either logs first
        while time.monotonic() < deadline and not all(s in server.log() for s in stopped):
            time.sleep(0.2)
        log = server.log()
        assert "talker: aborted" in log and "(0 requests running)" in log, log[-3000:]
        assert "code2wav: stopped" in log and "(0 streams running)" in log, log[-3000:]
        status, models = server.get_json("/v1/models")
        assert status == 200 and MODEL in json.dumps(models)
