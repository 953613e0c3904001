"""The WebSocket sessions open now, per kind (realtime, the speech input stream): each kind
bounded in number by its server option (docs/serving.md). A neutral module: the server state
holds the sets, and the endpoints' packages import that state.

A session takes its place before the WebSocket upgrade and gives it back when its socket is
gone, so a client over the bound is refused with HTTP 429 (OpenAI's error JSON, `Retry-After`)
and never costs an upgrade, a file descriptor held for the session's life, or the session's
state. A set holds the sessions themselves (not only a count) so that tests and operators can
see what is open; nothing else keeps a closed session alive.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from omni_server.serve.errors import ApiError

RETRY_AFTER_S = 1


class OpenSessions:
    """Event-loop thread only. The handler calls `check_room` and `add` with no await between
    (so two connects cannot both take the last place)."""

    def __init__(self) -> None:
        self._open: set[Any] = set()

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[Any]:  # a snapshot: a session may close while one looks
        return iter(list(self._open))

    def check_room(self, limit: int, *, what: str, flag: str) -> None:
        """429 (before the upgrade) when `limit` sessions of this kind are open: `what` names
        them in the message ("realtime sessions"), `flag` is the option that sets the bound."""
        if len(self._open) >= limit:
            raise ApiError(
                429,
                f"{limit} {what} are open, the most this server holds at once ({flag}); "
                f"retry after {RETRY_AFTER_S} s",
                code="rate_limit_exceeded",
                type="requests",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    def add(self, session: Any) -> None:
        self._open.add(session)

    def discard(self, session: Any) -> None:
        self._open.discard(session)
