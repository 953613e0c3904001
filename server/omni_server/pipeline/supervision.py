"""Supervision policy: when a dead stage process comes back, and when it stays dead.

A stage process that dies (or is killed for missing heartbeats, or for a backend call that
overran its stage's timeout_s) is restarted after a backoff that doubles with each death in
the crash-loop window (0.5 s, 1 s, 2 s ... capped at 8 s). The `crash_loop_deaths`-th death
inside `crash_loop_window_s` marks the instance failed: it stays down until the server
restarts. Mechanics (rewiring peers, spawning) live in processes.py; the runtime decides what
requests see (runtime.py).
"""

from __future__ import annotations

import collections
import enum
import time
from dataclasses import dataclass

HEARTBEAT_INTERVAL_S = 1.0  # how often a stage process beats (heartbeats.py)


@dataclass(frozen=True)
class SupervisionPolicy:
    restart: bool = True  # False: a dead process stays dead (its replicas keep serving)
    backoff_s: float = 0.5  # before the first restart; doubles per death in the window
    max_backoff_s: float = 8.0
    crash_loop_deaths: int = 5  # this many deaths within the window: the instance failed
    crash_loop_window_s: float = 60.0
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    heartbeat_timeout_s: float = 6.0  # silent this long: frozen, killed (0: never)

    def backoff(self, recent_deaths: int) -> float:
        """Delay before the restart that follows the `recent_deaths`-th death in the window."""
        return min(self.backoff_s * 2 ** max(recent_deaths - 1, 0), self.max_backoff_s)


class InstanceState(enum.StrEnum):
    UP = "up"  # ready, taking requests
    RESTARTING = "restarting"  # dead; a successor is waiting out its backoff or starting
    FAILED = "failed"  # crash loop (or not restartable): down until the server restarts


class CrashHistory:
    """Deaths of one instance inside the sliding window."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._deaths: collections.deque[float] = collections.deque()

    def record(self, now: float | None = None) -> int:
        """Count a death; returns the deaths inside the window, this one included."""
        now = time.monotonic() if now is None else now
        self._deaths.append(now)
        while self._deaths and self._deaths[0] <= now - self._window_s:
            self._deaths.popleft()
        return len(self._deaths)
