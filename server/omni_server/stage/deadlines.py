"""Stage timeouts inside a stage process: `timeout_s` per stage (stage.toml, or the server's
`stage_timeout_s`).

A request admitted to a stage gets a timer; if it is still there when the timer fires, the
stage aborts it locally and reports `StageTimedOut` to the coordinator, which fails it with
`PipelineError(code="timeout", stage=...)` and aborts it everywhere else.

A stage whose scheduler can end a request early (an "ar" stage whose backend has `finish`:
the thinker) ends it instead, as `max_tokens` would (finish_reason "length": the answer so far
is the request's result, not a failure); one still there another `timeout_s` later fails as
above.

A backend call cannot be cancelled (a Python thread cannot be interrupted). So the compute thread
records which call it runs since when (`compute.ComputeExecutor`), and a call that runs longer than
`timeout_s` marks the stage overran: the report asks the supervisor to kill the process, which
is then restarted (the requests it held fail as `process_died`). A stage process that is frozen
as a whole runs no timers: heartbeats (heartbeats.py) catch that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from .compute import ComputeExecutor

log = logging.getLogger(__name__)


class StageDeadlines:
    """Per-request timers of one stage (event-loop thread).

    `expired(key)` is called for a request still at the stage `timeout_s` after start(key);
    `overran()` once per backend call that is still running `timeout_s` after it began."""

    def __init__(
        self,
        timeout_s: float,
        executor: ComputeExecutor,
        expired: Callable[[int, bool], None],
        overran: Callable[[], None],
        finish: Callable[[int], bool] | None = None,
    ) -> None:
        """`finish(key)`: end the request early with what it has; False if it cannot."""
        self.timeout_s = timeout_s
        self._executor = executor
        self._expired = expired
        self._overran = overran
        self._finish = finish
        self._finishing: set[int] = set()  # ended early at timeout_s, not yet gone
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._watched_call: int | None = None
        self._call_timer: asyncio.TimerHandle | None = None

    def start(self, key: int) -> None:
        loop = asyncio.get_running_loop()
        self._timers[key] = loop.call_later(self.timeout_s, self._fire, key)

    def stop(self, key: int) -> None:
        self._finishing.discard(key)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def stop_all(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._finishing.clear()
        if self._call_timer is not None:
            self._call_timer.cancel()

    def _fire(self, key: int) -> None:
        del self._timers[key]
        overran = self._call_overran()
        early = not overran and key not in self._finishing and self._finish is not None
        if early and self._finish is not None and self._finish(key):
            log.info("request %d reached timeout_s (%g s): ended early", key, self.timeout_s)
            self._finishing.add(key)
            self._timers[key] = asyncio.get_running_loop().call_later(
                self.timeout_s, self._fire, key
            )
            return
        self._finishing.discard(key)
        self._expired(key, overran)

    def _call_overran(self) -> bool:
        """Whether the running call (if any) overran; if it may still, watch it."""
        current = self._executor.current
        if current is None:
            return False
        call, started = current
        age = time.monotonic() - started
        if age >= self.timeout_s:
            return True
        if self._watched_call != call:
            self._watched_call = call
            loop = asyncio.get_running_loop()
            self._call_timer = loop.call_later(self.timeout_s - age, self._check_call, call)
        return False

    def _check_call(self, call: int) -> None:
        current = self._executor.current
        if current is not None and current[0] == call:
            self._overran()
