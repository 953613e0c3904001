"""Playback-aware order for a stream stage whose chunks are media: each stream's deadline.

A listener starts playing a stream when its first chunk arrives and then plays without pause. A
stream that has produced `seconds` of media since its first chunk at `first_at` therefore needs
its next chunk by `first_at + seconds` (its deadline); `deadline - now` is its lead: how much
audio its listener still has beyond real time. A stream with seconds of lead can yield to one
with none, and to a new request, whose first chunk is wanted now.

The order (lower runs first; ties go to the oldest request):
  0. urgent streams: lead below the margin (the time a step may take), earliest deadline first;
     their next chunk must start now or the listener runs dry;
  1. first chunks (no deadline yet: time to first audio is the one thing a new request waits on);
  2. requests whose stream input is all read (their next step ends them and frees the caller);
  3. every other stream, earliest deadline first.
Nothing starves: a waiting stream's lead shrinks with time until it is urgent, and urgent
streams outrank everything.

A backend opts in by saying how long a chunk plays: `playback_seconds(chunk) -> float | None`
(docs/backends.md). Without it (or for a chunk it returns None for) the stage keeps the plain
order: first chunks, then finishing requests, then fewest chunks first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The margin: a stream becomes urgent when its lead falls below MARGIN_STEPS recent step times
# (a step of a sentence on a busy core takes hundreds of ms; the margin follows it), and never
# below MARGIN_FLOOR_S (scheduling and the path to the client take some time too).
MARGIN_STEPS = 2.0
MARGIN_FLOOR_S = 0.05
STEP_SMOOTHING = 0.2  # weight of the newest step in the moving average of step times


@dataclass
class Playback:
    """How far ahead of its listener one stream is. Times are `time.monotonic()` seconds."""

    first_at: float | None = None  # when its first chunk was produced
    seconds: float = 0.0  # media produced so far
    min_lead: float = math.inf  # the smallest lead any of its later chunks was produced with

    @property
    def started(self) -> bool:
        return self.first_at is not None

    def deadline(self) -> float:
        """When its listener runs out of audio (+inf before the first chunk: no listener yet)."""
        return math.inf if self.first_at is None else self.first_at + self.seconds

    def lead(self, now: float) -> float:
        return self.deadline() - now

    def produced(self, seconds: float, now: float) -> None:
        """A chunk of `seconds` of media is out at `now`; the first one starts the listener."""
        if self.first_at is None:
            self.first_at = now
        else:
            self.min_lead = min(self.min_lead, self.lead(now))
        self.seconds += seconds


class StepClock:
    """A moving average of how long a step takes: the margin urgent streams are judged by."""

    def __init__(self) -> None:
        self.average_s: float | None = None

    def record(self, seconds: float) -> None:
        if self.average_s is None:
            self.average_s = seconds
        else:
            self.average_s += STEP_SMOOTHING * (seconds - self.average_s)

    @property
    def margin_s(self) -> float:
        step = self.average_s or 0.0
        return max(MARGIN_FLOOR_S, MARGIN_STEPS * step)


def rank(
    chunks: int, finishing: bool, playback: Playback | None, now: float, margin_s: float
) -> tuple[int, float]:
    """The order key of one runnable request (see the module docstring); lower runs first."""
    if chunks == 0:
        return (1, 0.0)
    if playback is not None and playback.started:
        deadline = playback.deadline()
        if deadline - now < margin_s:
            return (0, deadline)
        if finishing:
            return (2, 0.0)
        return (3, deadline)
    if finishing:
        return (2, 0.0)
    return (3, float(chunks))
