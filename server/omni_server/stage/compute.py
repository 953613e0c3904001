"""A stage's compute thread: where its backend calls run, one at a time, and which call is
running since when (what `deadlines.StageDeadlines` reads to find a call that overran)."""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any


class ComputeExecutor(concurrent.futures.ThreadPoolExecutor):
    """A stage's one compute thread, which publishes the call it is running.

    `current` is read on the event loop: (call number, monotonic start) of the oldest call
    running on this executor or a sibling, or None. A stream stage with a first-chunk lane has
    a second compute thread (`sibling()`); both publish to one board (a dict keyed by executor,
    each entry written by that executor's thread only, replaced whole: one atomic store under
    the GIL), so the stage's watchdog sees a call that overran on either thread."""

    def __init__(
        self,
        thread_name_prefix: str,
        *,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
        _board: dict[int, tuple[int, float]] | None = None,
        _numbers: Iterator[int] | None = None,
    ) -> None:
        super().__init__(
            1, thread_name_prefix=thread_name_prefix, initializer=initializer, initargs=initargs
        )
        self._prefix = thread_name_prefix
        self._init = (initializer, initargs)
        self._board: dict[int, tuple[int, float]] = {} if _board is None else _board
        self._numbers = itertools.count(1) if _numbers is None else _numbers  # unique per board
        self._siblings: list[ComputeExecutor] = []

    @property
    def current(self) -> tuple[int, float] | None:
        running = list(self._board.values())
        return min(running, key=lambda call: call[1]) if running else None

    def sibling(self, suffix: str) -> ComputeExecutor:
        """A second compute thread of the same stage (same thread setup, one board of running
        calls); shut down with this one."""
        initializer, initargs = self._init
        lane = ComputeExecutor(
            self._prefix + suffix,
            initializer=initializer,
            initargs=initargs,
            _board=self._board,
            _numbers=self._numbers,
        )
        self._siblings.append(lane)
        return lane

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        return super().submit(self._timed, fn, args, kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        for lane in self._siblings:
            lane.shutdown(wait, cancel_futures=cancel_futures)
        super().shutdown(wait, cancel_futures=cancel_futures)

    def _timed(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        self._board[id(self)] = (next(self._numbers), time.monotonic())
        try:
            return fn(*args, **kwargs)
        finally:
            del self._board[id(self)]
