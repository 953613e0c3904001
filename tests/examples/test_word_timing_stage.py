"""The word_timing stage's steps (examples/higgs-audio-v2/word_timing/model.py, an ar stage fed
by the vocoder's chunks), driven directly with the real aligner: while a stream's alignment is
held up, every step still passes its new audio on at once (the alignment runs on the stage's
pool, never on its step); only the last bytes wait, and they carry the last words' timing; a
failing alignment fails its request alone; bad parameters are refused naming them.

The audio is tones with pauses between them (a segment to cut, no speech to hear): what is
tested is the stage's flow, not the times, which tests/voice/test_forced_alignment.py checks
on real speech."""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omni_server.backend import Request, StageConfigError, StageContext
from omni_server.compiler.compiler import compile_repository
from omni_server.contracts import SpeechTiming
from omni_server.stage.backends import load_backend
from tests.helpers.server import ROOT

RATE = 24_000
TEXT = "One two three. Four five six."
CHUNK = RATE * 16 // 100  # 160 ms of audio a chunk, as the vocoder's first


def word_timing(**parameters: Any) -> Any:
    spec = compile_repository(ROOT / "examples" / "higgs-audio-v2").stages["word_timing"]
    backend = load_backend(spec)
    backend.initialize(
        StageContext(
            stage="word_timing",
            parameters={**spec.parameters, **parameters},
            device="cpu",
            repository=Path("."),
            stage_dir=spec.directory,
        )
    )
    return backend


def utterance() -> np.ndarray:
    """2.4 s of tone, 0.4 s of silence, 1.6 s of tone: one cut in the pause."""
    t = np.arange(int(2.4 * RATE)) / RATE
    tone = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    return np.concatenate([tone, np.zeros(int(0.4 * RATE), np.float32), tone[: int(1.6 * RATE)]])


class Feed:
    """The vocoder's chunks of one request, handed over as its take_stream() asks."""

    def __init__(self, audio: np.ndarray) -> None:
        pieces = [audio[i : i + CHUNK] for i in range(0, len(audio), CHUNK)]
        self.chunks: deque[dict[str, Any]] = deque()
        for n, piece in enumerate(pieces):
            chunk = {"audio": piece.tobytes(), "samples": piece, "sample_rate": RATE}
            if n == 0:
                chunk["text"] = TEXT
            if n == len(pieces) - 1:
                chunk["result"] = {"finish_reason": "stop"}
            self.chunks.append(chunk)
        self.waiting: list[dict[str, Any]] = []
        self.request = Request("r", {}, _take=self._take)

    def _take(self) -> tuple[list[dict[str, Any]], bool]:
        taken, self.waiting = self.waiting, []
        return taken, False

    def arrive(self) -> bytes:
        """The next chunk arrives; its bytes ("" when none is left)."""
        if not self.chunks:
            return b""
        chunk = self.chunks.popleft()
        self.waiting.append(chunk)
        return chunk["audio"]


def test_audio_passes_while_the_alignment_is_held_up(monkeypatch) -> None:
    backend = word_timing()
    release, entered = threading.Event(), threading.Event()
    encode = backend.aligner.encode

    def held_encode(audio: np.ndarray) -> Any:
        entered.set()
        assert release.wait(60)
        return encode(audio)

    monkeypatch.setattr(backend.aligner, "encode", held_encode)
    feed = Feed(utterance())
    backend.add(feed.request)
    arrived, sent = bytearray(), bytearray()
    timings: list[SpeechTiming] = []
    result = None

    def step() -> None:
        nonlocal result
        for output in backend.step():
            assert output.error is None, output.error
            sent.extend(output.chunk["audio"])
            if SpeechTiming.KEY in output.chunk:
                timings.append(output.chunk[SpeechTiming.KEY])
            if output.finished:
                result = output.result

    pause_end = int(2.8 * RATE) // CHUNK + 1  # the chunks up to past the pause
    for _ in range(pause_end):
        arrived += feed.arrive()
        step()
    assert entered.wait(120)  # a worker holds the first segment's alignment
    while len(feed.chunks) > 1:  # the rest but the last, while it is held
        arrived += feed.arrive()
        step()
        assert sent == arrived  # each step's audio went out in that step
    release.set()
    feed.arrive()
    for _ in range(100_000):  # the last bytes wait for the last words' alignment
        step()
        if result is not None:
            break
    backend.finalize()
    assert result == {"finish_reason": "stop"}
    assert bytes(sent) == utterance().tobytes()
    timing = SpeechTiming.joined(timings)
    assert timing.text == TEXT and [w.text for w in timing.words] == TEXT.replace(".", "").split()


def test_a_failing_alignment_fails_its_request(monkeypatch) -> None:
    backend = word_timing()

    def broken(audio: np.ndarray) -> Any:
        raise RuntimeError("encoder broke")

    monkeypatch.setattr(backend.aligner, "encode", broken)
    feed = Feed(utterance())
    backend.add(feed.request)
    errors = []
    for _ in range(10_000):
        feed.arrive()
        errors += [o.error for o in backend.step() if o.error is not None]
        if errors:
            break
    backend.finalize()
    assert [str(e) for e in errors] == ["encoder broke"]
    assert not backend.has_work()


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"workers": 0}, "parameters.workers must be an integer >= 1"),
        ({"min_pause_s": "x"}, "parameters.min_pause_s must be a number"),
        ({"min_segment_s": 12.0}, "min_segment_s < max_segment_s"),
    ],
)
def test_bad_parameters_are_refused_naming_them(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(StageConfigError, match=message):
        word_timing(**parameters)
