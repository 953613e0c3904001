"""What the load driver talks to: a speech target turns one text into a timed clip.

Our server is driven over its OpenAI speech endpoint; the peers (`peers.py`) implement the
same small protocol, so every number in a run is measured the same way.
"""

from __future__ import annotations

import time
from typing import Protocol

import aiohttp

from omni_bench import server_stats
from omni_bench.metrics import Chunk, RequestTiming
from omni_server.audio.decode import Clip, decode

# Long paragraphs at c=16 on 2 cores can take a while; a hung server still ends the run.
REQUEST_TIMEOUT_S = 300.0


class SpeechTarget(Protocol):
    name: str

    async def start(self) -> None: ...

    async def synthesize(self, text: str) -> tuple[RequestTiming, Clip | None]:
        """Time one request; a failed request comes back with `timing.error` set and no clip."""
        ...

    async def close(self) -> None: ...


async def read_timed_body(response: aiohttp.ClientResponse, timing: RequestTiming) -> bytes:
    """Read the body chunk by chunk as it arrives, stamping each chunk's arrival time."""
    parts = []
    async for data in response.content.iter_any():
        timing.chunks.append(Chunk(time.perf_counter(), len(data)))
        parts.append(data)
    timing.end = time.perf_counter()
    return b"".join(parts)


async def error_text(response: aiohttp.ClientResponse) -> str:
    """`HTTP 400: message` from an OpenAI error body, or the raw body start."""
    body = await response.text()
    try:
        message = (await response.json(content_type=None))["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:200]
    return f"HTTP {response.status}: {message}"


class OpenAISpeechTarget:
    """Our server (or any OpenAI-compatible one): POST /v1/audio/speech."""

    def __init__(
        self,
        url: str,
        *,
        model: str | None,
        voice: str | None,
        response_format: str,
        stream: bool,
        seed: int | None = None,
        name: str = "omni-server",
    ) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.model = model
        self.voice = voice
        self.response_format = response_format
        self.stream = stream
        self.seed = seed
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # limit=0: the driver, not the connector, decides how many requests are in flight.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
        )
        if self.model is None:
            self.model = await self._first_model()

    async def _first_model(self) -> str:
        assert self._session is not None
        try:
            async with self._session.get(f"{self.url}/v1/models") as response:
                if response.status != 200:
                    raise ConnectionError(f"{self.url}/v1/models: {await error_text(response)}")
                models = (await response.json())["data"]
        except aiohttp.ClientError as err:
            raise ConnectionError(f"cannot reach {self.url}: {err}") from err
        if not models:
            raise ConnectionError(f"{self.url}/v1/models lists no model")
        return models[0]["id"]

    def request_body(self, text: str) -> dict:
        body: dict[str, object] = {
            "model": self.model,
            "input": text,
            "response_format": self.response_format,
        }
        if self.voice is not None:
            body["voice"] = self.voice
        # said either way: the server streams by default (as OpenAI does)
        if self.stream:
            body["stream_format"] = "audio"
        else:
            body["stream"] = False  # our extension: one whole body with a Content-Length
        if self.seed is not None:
            body["seed"] = self.seed  # our extension: same seed, same text -> same audio
        return body

    async def synthesize(self, text: str) -> tuple[RequestTiming, Clip | None]:
        assert self._session is not None, "start() first"
        return await timed_post(
            self._session,
            f"{self.url}/v1/audio/speech",
            self.request_body(text),
            text,
            self.response_format,
        )

    async def stats(self) -> server_stats.Snapshot | None:
        assert self._session is not None, "start() first"
        return await server_stats.scrape(self._session, self.url)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def timed_post(
    session: aiohttp.ClientSession, url: str, body: dict, text: str, response_format: str
) -> tuple[RequestTiming, Clip | None]:
    """POST one JSON request for `text` and time its answer; an HTTP error, a broken connection
    or a body without audio is a failed request, its reason in `timing.error`."""
    timing = RequestTiming(text=text, start=time.perf_counter())
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                timing.error = await error_text(response)
                timing.end = time.perf_counter()
                return timing, None
            audio = await read_timed_body(response, timing)
    except (aiohttp.ClientError, TimeoutError) as err:
        timing.error = f"{type(err).__name__}: {err}"
        timing.end = time.perf_counter()
        return timing, None
    return finish(timing, audio, response_format)


def finish(
    timing: RequestTiming, body: bytes, response_format: str
) -> tuple[RequestTiming, Clip | None]:
    """Decode the body after the clock stopped; an empty or undecodable body is a failure."""
    if not body:
        timing.error = "empty body"
        return timing, None
    try:
        clip = decode(body, response_format)
    except ValueError as err:
        timing.error = str(err)
        return timing, None
    if clip.seconds <= 0:
        timing.error = "body decodes to no audio"
        return timing, None
    timing.audio_seconds = clip.seconds
    return timing, clip
