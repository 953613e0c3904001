"""Whisper windows of several clips in one call: each clip's progress, and which windows go next.

A `Transcription` is one clip on its way through the recognizer (`whisper.Recognizer`): the
windows it still has to decode (a window Whisper left early is decoded again from where it
stopped, before the windows after it), what each window heard, and the segments it can hand
out, always in window order. `plan_batch` picks the windows of the next recognizer call from
every transcription under way, so the windows of concurrent requests share one CTranslate2
batch (the encoder and the beam search cost less a window in a larger batch: docs/asr.md).

Invariants:
- a transcription's segments come out in window order, each window's whole (resumes included)
  before the next window's;
- each transcription puts at most its allowance into one call: 1 in its first, then doubling up
  to the recognizer's batch size (a request's first text comes after one window's work);
- one call decodes windows of one kind only (`DecodeOptions.prompt` and `temperature` are the
  call's, so requests that differ there are never batched together);
- windows are taken round-robin across transcriptions (oldest first), so a long file's windows
  never keep a short clip waiting for more than one call.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

RATE = 16_000  # Whisper's sample rate


class DecodeOptions(Protocol):
    """What a clip asks of its calls (`whisper.DecodeOptions`; not imported: it imports this)."""

    @property
    def prompt(self) -> str | None: ...

    @property
    def temperature(self) -> float: ...

    @property
    def words(self) -> bool: ...

    @property
    def logprobs(self) -> bool: ...


@dataclass
class Window:
    owner: Transcription
    slot: int  # position among its clip's windows: segments come out in slot order
    start: float  # seconds of the owner's audio
    end: float
    resumes: int = 0


class Transcription:
    """One 16 kHz clip's windows through the recognizer."""

    def __init__(
        self,
        audio: np.ndarray,
        windows: Sequence[tuple[float, float]],
        options: DecodeOptions,
        *,
        most: int,
    ) -> None:
        if most < 1:
            raise ValueError(f"most must be >= 1, got {most}")
        self.audio = audio
        self.options = options
        limit = audio.size / RATE  # faster-whisper asserts windows fit in the audio
        spans = [(max(0.0, s), min(e, limit)) for s, e in windows if min(e, limit) > s]
        self._todo = deque(Window(self, i, s, e) for i, (s, e) in enumerate(spans))
        self._heard: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(spans))}
        self._done: set[int] = set()
        self._emitted = 0
        self._count = len(spans)
        self._allowance = 1
        self._most = most

    @property
    def pending(self) -> int:
        """Windows (or rests of windows) waiting to be decoded."""
        return len(self._todo)

    @property
    def allowance(self) -> int:
        """How many of its windows the next call may take."""
        return min(self._allowance, len(self._todo))

    @property
    def finished(self) -> bool:
        """Every window was heard to its end and handed out."""
        return self._emitted == self._count

    @property
    def batch_kind(self) -> tuple[str | None, float]:
        """What a call must share to decode this clip's windows with another's."""
        return (self.options.prompt or None, self.options.temperature)

    def take(self) -> Window:
        return self._todo.popleft()

    def took(self) -> None:
        """A call took windows of this clip: the next may take twice as many."""
        self._allowance = min(self._allowance * 2, self._most)

    def settle(self, heard: Sequence[tuple[Window, list[dict[str, Any]], Window | None]]) -> None:
        """One call's results for this clip's windows: (window, its segments, the rest to
        decode again or None), in the order the call took them."""
        resumed = []
        for window, segments, rest in heard:
            if window.owner is not self or (rest is not None and rest.owner is not self):
                raise ValueError("settle() was handed another clip's window")
            self._heard[window.slot] += segments
            if rest is None:
                self._done.add(window.slot)
            else:
                resumed.append(rest)
        self._todo.extendleft(reversed(resumed))  # resumed windows go first, in slot order

    def ready(self) -> list[dict[str, Any]]:
        """The segments that can be handed out now (in order), [] when none."""
        out: list[dict[str, Any]] = []
        while self._emitted in self._done:
            out += self._heard.pop(self._emitted)
            self._emitted += 1
        return out


def plan_batch(transcriptions: Sequence[Transcription], most: int) -> list[Window]:
    """The windows of the next call: at most `most`, from the transcriptions (oldest first)
    that share the oldest pending one's batch kind, round-robin up to each one's allowance."""
    pending = [t for t in transcriptions if t.pending]
    if not pending or most < 1:
        return []
    kind = pending[0].batch_kind
    quota = {id(t): t.allowance for t in pending if t.batch_kind == kind}
    group = [t for t in pending if id(t) in quota]
    batch: list[Window] = []
    while len(batch) < most and any(quota.values()):
        for t in group:
            if quota[id(t)] and len(batch) < most:
                batch.append(t.take())
                quota[id(t)] -= 1
    for t in dict.fromkeys(w.owner for w in batch):
        t.took()
    return batch
