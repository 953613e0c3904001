"""How far ahead of its listener one media stream is: the clock of playback-aware order.

A listener starts playing a stream when its first piece of media arrives and then plays without
pause. A stream that has produced `seconds` of media since its first piece at `first_at`
therefore needs its next piece by `first_at + seconds` (its deadline); `deadline - now` is its
lead: how much audio its listener still has beyond real time.

A leaf module shared by the two places that order work by it: the stream scheduler
(stage/scheduling/stream_order.py: which request's generator steps next) and the engine's
continuous batcher (engine/deadline_order.py: which sequences the next forward holds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The margin: a stream becomes urgent when its lead falls below MARGIN_STEPS recent step times
# (a step of a sentence on a busy core takes hundreds of ms, an engine step with a long prefill
# tens; the margin follows it), and never
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
