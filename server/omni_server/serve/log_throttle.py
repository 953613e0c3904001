"""Resource-exhaustion log lines at most once a second.

When the process runs out of file descriptors every accept and every open fails, and each
failure logs a traceback: thousands of lines a second, which fill the disk while helping no
one. `ExhaustionFilter` lets one such record through per interval and counts the rest into the
next one it lets through ("... (N more like this suppressed)"). Other records pass untouched.
"""

from __future__ import annotations

import errno
import logging
import time

EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
MARKERS = ("Too many open files", "out of system resource")


class ExhaustionFilter(logging.Filter):
    def __init__(self, interval_s: float = 1.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last = float("-inf")
        self._suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not _is_exhaustion(record):
            return True
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._suppressed += 1
            return False
        self._last = now
        if self._suppressed:
            record.msg = f"{record.msg} ({self._suppressed} more like this suppressed)"
            self._suppressed = 0
        return True


def _is_exhaustion(record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, OSError) and exc.errno in EXHAUSTED:
        return True
    text = str(record.msg)
    return any(marker in text for marker in MARKERS)


def install(logger: logging.Logger | None = None) -> ExhaustionFilter:
    """Put one filter on every handler of `logger` (the root logger by default): a filter on a
    handler sees records from every logger that propagates to it."""
    throttle = ExhaustionFilter()
    for handler in (logger or logging.getLogger()).handlers:
        handler.addFilter(throttle)
    return throttle
