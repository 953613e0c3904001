"""`AsyncOmniClient`: the asyncio client, line for line the twin of `OmniClient` (sync_client.py)
on httpx2's `AsyncClient` (one keep-alive connection pool)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2

from omni_client import errors, protocol, transport


class AsyncOmniClient:
    """The asyncio twin of `OmniClient`, with the same methods as coroutines (`stream_pcm` and
    `stream_transcription` are async iterators). Close it (`await client.close()` or
    `async with`) on the event loop that used it.
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
        self._http = httpx2.AsyncClient(
            **transport.client_options(self.base_url, api_key, timeout, max_connections)
        )

    async def __aenter__(self) -> AsyncOmniClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    # -- speech --------------------------------------------------------------------------------

    async def speech(
        self,
        text: str,
        *,
        model: str = protocol.DEFAULT_MODEL,
        voice: str = protocol.DEFAULT_VOICE,
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
            return await response.aread()

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
        voice: str = protocol.DEFAULT_VOICE,
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
            async for data in response.aiter_bytes():
                if chunk := aligner.feed(data):
                    yield chunk
        aligner.finish()

    # -- transcription -------------------------------------------------------------------------

    async def transcribe(
        self,
        file: protocol.AudioFile,
        *,
        model: str = protocol.DEFAULT_TRANSCRIPTION_MODEL,
        language: str | None = None,
        prompt: str | None = None,
        temperature: float | None = None,
        response_format: str = "json",
        timestamp_granularities: list[str] | tuple[str, ...] | None = None,
        filename: str | None = None,
    ) -> dict[str, Any] | str:
        """The transcript of an audio file (see `OmniClient.transcribe`)."""
        request = protocol.transcription_request(
            file,
            model=model,
            language=language,
            prompt=prompt,
            temperature=temperature,
            response_format=response_format,
            timestamp_granularities=timestamp_granularities,
            stream=False,
            filename=filename,
        )
        async with self._send(request) as response:
            return protocol.decode_transcript(
                await response.aread(),
                response_format,
                url=str(response.request.url),
                content_type=response.headers.get("content-type"),
            )

    async def stream_transcription(
        self,
        file: protocol.AudioFile,
        *,
        model: str = protocol.DEFAULT_TRANSCRIPTION_MODEL,
        language: str | None = None,
        prompt: str | None = None,
        temperature: float | None = None,
        filename: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """The transcript as it is heard (see `OmniClient.stream_transcription`)."""
        request = protocol.transcription_request(
            file,
            model=model,
            language=language,
            prompt=prompt,
            temperature=temperature,
            response_format="json",
            timestamp_granularities=None,
            stream=True,
            filename=filename,
        )
        async with self._send(request) as response:
            url = str(response.request.url)
            events, transcript = protocol.SseEvents(url), protocol.TranscriptStream(url)
            async for data in response.aiter_bytes():
                for event in events.feed(data):
                    yield transcript.check(event)
            events.finish()
            transcript.finish()

    # -- discovery -----------------------------------------------------------------------------

    async def models(self) -> list[dict[str, Any]]:
        """The served models (`GET /v1/models`): dicts with at least `id`."""
        return (await self._json(protocol.MODELS))["data"]

    async def health(self) -> dict[str, Any]:
        """`GET /health`: the server's status JSON; an `APIError` while it is not ready."""
        return await self._json(protocol.HEALTH)

    async def repository_index(self, *, ready: bool = False) -> list[dict[str, Any]]:
        """Every model of the server's repository (`POST /v2/repository/index`): dicts with
        `name`, `state` (READY, UNAVAILABLE, LOADING, UNLOADING), `reason`, and `version`
        while loaded; `ready`: only READY ones."""
        return await self._json(protocol.repository_index(ready=ready))

    async def load_model(self, name: str, config: dict[str, Any] | None = None) -> None:
        """Load or reload `name` (an atomic swap: returns once the new version serves);
        `config` overrides repository fields for it ({"stages.s.parameters.k": 1}). An
        `APIError` (400, 404, 500 with the reason) when it fails; the old version serves on."""
        await self._call(protocol.load_model(name, config))

    async def unload_model(self, name: str, *, unload_dependents: bool = False) -> None:
        """Unload `name` once its running requests finished (with `unload_dependents`, every
        model sharing a stage with it too)."""
        await self._call(protocol.unload_model(name, unload_dependents=unload_dependents))

    # -- transport -----------------------------------------------------------------------------

    async def _call(self, request: protocol.Request) -> None:
        async with self._send(request) as response:
            await response.aread()

    @asynccontextmanager
    async def _send(self, request: protocol.Request) -> AsyncIterator[httpx2.Response]:
        """An open, successful streaming response; transport failures become typed errors."""
        with errors.translated(self.base_url):
            async with self._http.stream(
                request.method, request.path, **transport.body(request)
            ) as response:
                if response.status_code >= 400:
                    raise errors.APIError.from_body(
                        response.status_code, await response.aread(), response.reason_phrase
                    )
                yield response

    async def _json(self, request: protocol.Request) -> Any:
        async with self._send(request) as response:
            return protocol.decode_json(
                await response.aread(),
                url=str(response.request.url),
                content_type=response.headers.get("content-type"),
            )
