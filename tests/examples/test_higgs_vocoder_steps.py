"""The Higgs vocoder's steps (examples/higgs-audio-v2/vocoder/model.py, an ar stage fed by the
engine's frames), driven directly: the step budget and the batch size change when a window is
decoded, never what a stream hears; the most urgent windows go first; bad step parameters are
refused naming them.

The audio tokenizer is a stand-in here (labelled: `ColumnCodec`, each column's samples are its
first codebook's code, so any window decodes exactly as the whole stream would): what is tested
is the stage's bookkeeping, not the decoder, which tests/examples/test_higgs_audio_v2.py checks
against transformers."""

from __future__ import annotations

import sys
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from omni_server.audio.higgs_codec import delayed
from omni_server.backend import Request, StageConfigError, StageContext
from omni_server.compiler.compiler import compile_repository
from omni_server.stage.backends import load_backend
from tests.helpers.server import ROOT

HOP = 4  # samples a column
K, CODEBOOK = 8, 1024


class ColumnCodec:
    """Stand-in decoder: column j of a window becomes HOP samples equal to codes[0, j] / 1024."""

    config = SimpleNamespace(num_quantizers=K, codebook_size=CODEBOOK, hop_length=HOP)

    def decode(self, codes: torch.Tensor, return_dict: bool = False) -> torch.Tensor:
        first = codes[:, 0, :].float() / CODEBOOK  # [B, L]
        return first.repeat_interleave(HOP, dim=1).unsqueeze(1)  # [B, 1, L * HOP]


def vocoder(monkeypatch: pytest.MonkeyPatch, **parameters: Any) -> Any:
    spec = compile_repository(ROOT / "examples" / "higgs-audio-v2").stages["vocoder"]
    backend = load_backend(spec)
    module = sys.modules[type(backend).__module__]
    monkeypatch.setattr(module, "open_checkpoint", lambda repository_parameters: None)
    monkeypatch.setattr(module, "load_audio_tokenizer", lambda checkpoint, device: ColumnCodec())
    backend.initialize(
        StageContext(
            stage="vocoder",
            parameters={**spec.parameters, **parameters},
            device="cpu",
            repository=Path("."),
            stage_dir=spec.directory,
        )
    )
    return backend


class Feed:
    """One request as the engine would stream it: its frames (delay pattern), `per_step` a
    step, from step `start` on; `take_stream` hands the vocoder what has come."""

    def __init__(self, name: str, columns: int, start: int, rng: np.random.Generator) -> None:
        self.codes = rng.integers(0, CODEBOOK, size=(columns, K))
        frames = delayed(self.codes, CODEBOOK, CODEBOOK + 1)
        self.chunks: deque[dict[str, Any]] = deque()
        for i, frame in enumerate(frames):
            chunk: dict[str, Any] = {"frames": [frame]}
            if i == 0:
                chunk["encoding"] = {"format": "pcm", "sample_rate": 24000, "stream": True}
            if i == len(frames) - 1:
                chunk["finish_reason"] = "stop"
            self.chunks.append(chunk)
        self.start = start
        self.waiting: list[dict[str, Any]] = []
        self.request = Request(name, {}, _take=self._take)
        self.audio = b""
        self.result: dict[str, Any] | None = None

    def _take(self) -> tuple[list[dict[str, Any]], bool]:
        taken, self.waiting = self.waiting, []
        return taken, False

    def arrive(self, step: int) -> None:
        if step >= self.start and self.chunks:
            self.waiting.append(self.chunks.popleft())


def serve(backend: Any, feeds: list[Feed], steps: int = 2000) -> tuple[list[list[str]], int]:
    """Step the backend as its scheduler would: each step's requests that got audio, and how
    many steps left work behind (has_work)."""
    heard: list[list[str]] = []
    behind = 0
    added: set[str] = set()
    for step in range(steps):
        for feed in feeds:
            feed.arrive(step)
            if step >= feed.start and feed.request.id not in added:
                added.add(feed.request.id)
                backend.add(feed.request)
        got = []
        for output in backend.step():
            feed = next(f for f in feeds if f.request is output.request)
            assert output.error is None, output.error
            if output.chunk is not None:
                feed.audio += output.chunk["audio"]
                got.append(feed.request.id)
            if output.finished:
                feed.result = output.result
        heard.append(got)
        behind += backend.has_work()
        if all(f.result is not None for f in feeds):
            return heard, behind
    raise AssertionError("streams did not end")


def test_budget_and_batch_change_when_a_window_decodes_not_what_is_heard(monkeypatch) -> None:
    shapes = [(150, 0), (40, 0), (90, 3), (17, 5), (150, 5)]  # (columns, first step)
    runs = {}
    for label, params in {
        "all at once": {"decode_batch": 64, "step_budget_ms": 1e6},
        "one window a step": {"decode_batch": 1, "step_budget_ms": 1e-9},
    }.items():
        feeds = [Feed(f"r{i}", *shape, np.random.default_rng(i)) for i, shape in enumerate(shapes)]
        backend = vocoder(monkeypatch, **params)
        runs[label] = feeds, *serve(backend, feeds)
    (whole, heard_whole, behind_whole), (bounded, heard_bounded, behind) = runs.values()
    assert behind_whole == 0 and behind > 0  # the bounded steps did fall behind
    assert heard_bounded != heard_whole  # so their audio went out at other steps
    for one, other in zip(whole, bounded, strict=True):
        assert other.audio == one.audio
        assert other.result["frames"] == one.result["frames"] == len(one.codes)
        # what a stream hears is its codes, column by column (the stand-in's one decode)
        pcm = np.frombuffer(one.audio, np.int16) / 32767
        expected = np.repeat(one.codes[:, 0] / CODEBOOK, HOP)
        np.testing.assert_allclose(pcm, expected, atol=1e-4)


def test_a_first_chunk_goes_before_later_chunks_when_time_is_short(monkeypatch) -> None:
    """A stream far along and one just started are both due in one step; with time for one
    decoder call, the newcomer's first chunk is decoded and the other's waits for the next
    step (the backend says so: has_work)."""
    backend = vocoder(monkeypatch, decode_batch=1, step_budget_ms=1e-9)
    old = Feed("old", 150, 0, np.random.default_rng(1))
    serve_until = 40  # old has sent its chunks of 4 and 8 columns by then
    for step in range(serve_until):
        old.arrive(step)
        if step == 0:
            backend.add(old.request)
        backend.step()
    new = Feed("new", 150, 0, np.random.default_rng(2))
    backend.add(new.request)
    for _ in range(1 + 7 + 14):  # the BOS frame, the delay, 14 columns: its first chunk alone
        new.waiting.append(new.chunks.popleft())
    for _ in range(30):  # and old has two chunks' worth waiting
        old.arrive(serve_until)
    outputs = backend.step()
    got = {o.request.id for o in outputs if o.chunk is not None}
    assert got == {"new"}
    assert backend.has_work()
    assert {o.request.id for o in backend.step() if o.chunk is not None} == {"old"}


@pytest.mark.parametrize(
    ("parameter", "value"),
    [("decode_batch", 0), ("decode_batch", 2.5), ("step_budget_ms", 0), ("step_budget_ms", True)],
)
def test_a_bad_step_parameter_is_refused_naming_it(monkeypatch, parameter, value) -> None:
    with pytest.raises(StageConfigError, match=f"parameters.{parameter} must be"):
        vocoder(monkeypatch, **{parameter: value})
