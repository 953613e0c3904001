"""Writing a streamed response within a time bound.

aiohttp's `write` waits while the socket's buffer is full, for as long as the client does not
read: a client that stops reading would hold its request (its admission place, its pipeline
state) forever. `write_within` gives each write `write_timeout_s`; a client that takes no bytes
for that long is dropped like one that disconnected (`ConnectionResetError`, which the
endpoints count as `client_disconnected`). A slow reader that keeps reading is never cut: the
bound is per write, not per response.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from omni_server.serve.state import STATE


async def write_within(request: web.Request, response: web.StreamResponse, data: bytes) -> None:
    timeout = request.app[STATE].options.write_timeout_s
    try:
        async with asyncio.timeout(timeout):
            await response.write(data)
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()  # no final chunk: the stream must not look complete
        raise ConnectionResetError(f"the client read nothing for {timeout:g} s") from None
