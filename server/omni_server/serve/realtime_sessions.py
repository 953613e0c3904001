"""The realtime sessions open now (serve/realtime/): bounded in number, each bounded in bytes
(docs/realtime.md#bounds). A module of its own, outside the realtime package, because the
server state holds it and the package imports that state.

A session takes its place before the WebSocket upgrade and gives it back when its socket is
gone, so a client over the bound is refused with HTTP 429 (OpenAI's error JSON, `Retry-After`)
and never costs an upgrade, a VAD model state or a conversation. The set holds the sessions
themselves (not only a count) so that tests and operators can see what is open; nothing else
keeps a closed session alive.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

RETRY_AFTER_S = 1


class OpenSessions:
    """Event-loop thread only. The handler checks `len()` and adds with no await between."""

    def __init__(self) -> None:
        self._open: set[Any] = set()

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[Any]:  # a snapshot: a session may close while one looks
        return iter(list(self._open))

    def add(self, session: Any) -> None:
        self._open.add(session)

    def discard(self, session: Any) -> None:
        self._open.discard(session)
