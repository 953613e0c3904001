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

from omni_server.playback import MARGIN_FLOOR_S, MARGIN_STEPS, Playback, StepClock

__all__ = ["MARGIN_FLOOR_S", "MARGIN_STEPS", "Playback", "StepClock", "rank"]


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
