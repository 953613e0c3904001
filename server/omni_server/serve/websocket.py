"""The server's WebSocket: aiohttp's, closing on an oversized message so that the client reads
why (1009, message too big, with a reason), whatever the size it sent.

aiohttp refuses a frame over `max_msg_size` as soon as it reads the frame's header: it sends
the close frame (1009) and closes the socket. The rest of the frame is then still on its way
(a 16 MiB frame has barely started), and a socket closed with unread bytes is reset: the
client's kernel drops what it had received, the close frame included, and the client sees an
abnormal closure (1006) instead of 1009. So the close is a lingering one: the socket is kept
(a duplicate of its descriptor, so aiohttp's own close sends nothing), shut for writing after
the close frame, and read and discarded until the client closes it, for at most
`LINGER_S` and `LINGER_BYTES`; past either it is closed as aiohttp would have.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import Any

from aiohttp import WSCloseCode, web

log = logging.getLogger(__name__)

LINGER_S = 5.0  # a client sending the rest of a 16 MiB frame at ~4 MB/s still gets its 1009
LINGER_BYTES = 256 << 20  # what a lingering close reads and discards at most
_LINGERING: set[asyncio.Task[None]] = set()  # the running lingers (the loop keeps weak refs)


class BoundedWebSocket(web.WebSocketResponse):
    """`web.WebSocketResponse` whose close for an oversized message (aiohttp's 1009) names the
    bound and lingers (module docstring); every other close is aiohttp's."""

    def __init__(self, *, max_msg_size: int, **kwargs: Any) -> None:
        super().__init__(max_msg_size=max_msg_size, **kwargs)
        self.max_message_bytes = max_msg_size
        self._upgraded: web.BaseRequest | None = None  # the request prepare() upgraded

    async def prepare(self, request: web.BaseRequest) -> Any:
        self._upgraded = request
        return await super().prepare(request)

    async def close(
        self, *, code: int = WSCloseCode.OK, message: bytes = b"", drain: bool = True
    ) -> bool:
        if code != WSCloseCode.MESSAGE_TOO_BIG or self.closed:
            return await super().close(code=code, message=message, drain=drain)
        if not message:  # aiohttp's own close for the frame it refused gives no reason
            message = f"message too big: at most {self.max_message_bytes} bytes".encode()
        kept = self._keep_socket()
        try:
            return await super().close(code=code, message=message, drain=drain)
        finally:
            if kept is not None:
                # a task of its own: aiohttp cancels the handler once its transport is closed,
                # and a cancelled linger would reset the connection after all
                task = asyncio.get_running_loop().create_task(_linger(kept))
                _LINGERING.add(task)
                task.add_done_callback(_LINGERING.discard)

    def _keep_socket(self) -> socket.socket | None:
        """A duplicate of the connection's socket (None when there is none to keep)."""
        transport = self._upgraded.transport if self._upgraded is not None else None
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None:
            return None
        kept = socket.socket(fileno=os.dup(sock.fileno()))
        kept.setblocking(False)
        return kept


async def _linger(kept: socket.socket) -> None:
    """Send FIN after the close frame, then read and discard what the client still sends until
    it closes (or LINGER_S / LINGER_BYTES pass), then close the last descriptor."""
    loop = asyncio.get_running_loop()
    read = 0
    try:
        kept.shutdown(socket.SHUT_WR)
        async with asyncio.timeout(LINGER_S):
            while read <= LINGER_BYTES:
                data = await loop.sock_recv(kept, 1 << 16)
                if not data:
                    return  # the client closed: it has read the close frame
                read += len(data)
    except (TimeoutError, OSError) as err:  # still sending, or already gone: closed as is
        log.debug("lingering close ended after %d bytes: %r", read, err)
    finally:
        with contextlib.suppress(OSError):
            kept.close()
