"""`AsyncOmniClient`: the asyncio client, on one aiohttp session (keep-alive connection pool)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp

from omni_client import errors, protocol


class AsyncOmniClient:
    """The asyncio twin of `OmniClient`, with the same methods as coroutines.

    `timeout` bounds connecting and each gap between received bytes, not the whole request.
    The aiohttp session is opened on first use inside the running event loop; close the client
    (`await client.close()` or `async with`) on the loop that used it.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float = protocol.DEFAULT_TIMEOUT_S,
        max_connections: int = 100,
    ) -> None:
        self.base_url = protocol.base_url(base_url)
        self._headers = protocol.auth_headers(api_key)
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AsyncOmniClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- speech --------------------------------------------------------------------------------

    async def speech(
        self,
        text: str,
        *,
        model: str = protocol.DEFAULT_MODEL,
        voice: str | None = None,
        format: str = "mp3",
        speed: float | None = None,
        seed: int | None = None,
        instructions: str | None = None,
        sample_rate: int | None = None,
    ) -> bytes:
        """The whole encoded audio of `text` (`format`: mp3, opus, aac, flac, wav or pcm)."""
        request = protocol.speech_request(
            text,
            model=model,
            voice=voice,
            format=format,
            speed=speed,
            seed=seed,
            instructions=instructions,
            sample_rate=sample_rate,
            stream=False,
        )
        async with self._send(request) as response:
            return await response.read()

    async def speech_to_file(
        self,
        path: str | os.PathLike[str],
        text: str,
        *,
        format: str | None = None,
        **options: Any,
    ) -> Path:
        """Synthesize `text` into `path`; the format comes from the extension unless given."""
        path = Path(path)
        audio = await self.speech(text, format=format or protocol.format_for_path(path), **options)
        path.write_bytes(audio)
        return path

    async def stream_pcm(
        self,
        text: str,
        *,
        model: str = protocol.DEFAULT_MODEL,
        voice: str | None = None,
        speed: float | None = None,
        seed: int | None = None,
        instructions: str | None = None,
        sample_rate: int | None = None,
    ) -> AsyncIterator[bytes]:
        """Raw s16le mono PCM (24000 Hz unless `sample_rate`) in chunks as the server sends them.

        Each chunk holds whole samples. Leaving the loop early (then `aclose()`, or
        `contextlib.aclosing`) closes the connection, which tells the server to abort.
        """
        request = protocol.speech_request(
            text,
            model=model,
            voice=voice,
            format="pcm",
            speed=speed,
            seed=seed,
            instructions=instructions,
            sample_rate=sample_rate,
            stream=True,
        )
        aligner = protocol.SampleAligner()
        async with self._send(request) as response:
            async for data in response.content.iter_any():
                if chunk := aligner.feed(data):
                    yield chunk
        aligner.finish()

    # -- discovery -----------------------------------------------------------------------------

    async def models(self) -> list[dict[str, Any]]:
        """The served models (`GET /v1/models`): dicts with at least `id`."""
        return (await self._json(protocol.MODELS))["data"]

    async def health(self) -> dict[str, Any]:
        """`GET /health`: the server's status JSON; an `APIError` while it is not ready."""
        return await self._json(protocol.HEALTH)

    # -- transport -----------------------------------------------------------------------------

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                base_url=self.base_url,
                headers=self._headers,
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(limit=self._max_connections),
            )
        return self._session

    @asynccontextmanager
    async def _send(self, request: protocol.Request) -> AsyncIterator[aiohttp.ClientResponse]:
        """An open, successful response; transport failures become typed errors."""
        try:
            async with self._http().request(
                request.method, request.path, json=request.json
            ) as response:
                if response.status >= 400:
                    body = await response.read()
                    raise errors.APIError.from_body(response.status, body, response.reason or "")
                yield response
        # aiohttp's timeouts are both ClientError and TimeoutError: test for timeouts first
        except TimeoutError as e:
            raise errors.timed_out(self.base_url, e) from e
        except aiohttp.ClientConnectorError as e:
            raise errors.cannot_connect(self.base_url, e) from e
        except aiohttp.ClientError as e:
            raise errors.broken_off(self.base_url, f"{type(e).__name__}: {e}") from e

    async def _json(self, request: protocol.Request) -> Any:
        async with self._send(request) as response:
            return protocol.decode_json(
                await response.read(),
                url=str(response.url),
                content_type=response.headers.get("Content-Type"),
            )
