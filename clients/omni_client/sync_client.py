"""`OmniClient`: the blocking client, on one pooled httpx2 connection set (keep-alive reuse)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2

from omni_client import protocol
from omni_client.errors import APIError, OmniConnectionError, OmniError, OmniTimeoutError


class OmniClient:
    """Blocking client for an omni-server (or any OpenAI-speech-compatible server).

    `timeout` bounds each wait (connecting, sending, and the gap between received bytes), not
    the whole request: a long synthesis that keeps streaming never times out. Thread-safe; reuse
    one instance so that connections are kept alive. Close it, or use it as a context manager.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float = protocol.DEFAULT_TIMEOUT_S,
    ) -> None:
        self.base_url = protocol.base_url(base_url)
        self._http = httpx2.Client(
            base_url=self.base_url,
            headers=protocol.auth_headers(api_key),
            timeout=httpx2.Timeout(timeout),
        )

    def __enter__(self) -> OmniClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- speech --------------------------------------------------------------------------------

    def speech(
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
        body = protocol.speech_body(
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
        with self._request("POST", "/v1/audio/speech", json=body) as response:
            return _read_all(response)

    def speech_to_file(
        self,
        path: str | os.PathLike[str],
        text: str,
        *,
        format: str | None = None,
        **options: Any,
    ) -> Path:
        """Synthesize `text` into `path`; the format comes from the extension unless given."""
        path = Path(path)
        audio = self.speech(text, format=format or protocol.format_for_path(path), **options)
        path.write_bytes(audio)
        return path

    def stream_pcm(
        self,
        text: str,
        *,
        model: str = protocol.DEFAULT_MODEL,
        voice: str | None = None,
        speed: float | None = None,
        seed: int | None = None,
        instructions: str | None = None,
        sample_rate: int | None = None,
    ) -> Iterator[bytes]:
        """Raw s16le mono PCM (24000 Hz unless `sample_rate`) in chunks as the server sends them.

        Each chunk holds whole samples. Stopping the iteration early closes the connection,
        which tells the server to abort the request.
        """
        body = protocol.speech_body(
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
        with self._request("POST", "/v1/audio/speech", json=body) as response:
            for data in _iter_bytes(response):
                if chunk := aligner.feed(data):
                    yield chunk
        aligner.finish()

    # -- discovery -----------------------------------------------------------------------------

    def models(self) -> list[dict[str, Any]]:
        """The served models (`GET /v1/models`): dicts with at least `id`."""
        with self._request("GET", "/v1/models") as response:
            return _json(response)["data"]

    def health(self) -> dict[str, Any]:
        """`GET /health`: the server's status JSON; an `APIError` while it is not ready."""
        with self._request("GET", "/health") as response:
            return _json(response)

    # -- transport -----------------------------------------------------------------------------

    @contextmanager
    def _request(self, method: str, path: str, **kwargs: Any) -> Iterator[httpx2.Response]:
        """An open, successful streaming response; transport failures become typed errors."""
        with (
            _translated_errors(self.base_url),
            self._http.stream(method, path, **kwargs) as response,
        ):
            if response.status_code >= 400:
                raise APIError.from_body(
                    response.status_code, response.read(), response.reason_phrase
                )
            yield response


@contextmanager
def _translated_errors(url: str) -> Iterator[None]:
    try:
        yield
    except httpx2.TimeoutException as e:
        raise OmniTimeoutError(f"{url}: timed out ({type(e).__name__})") from e
    except httpx2.TransportError as e:
        raise OmniConnectionError(f"{url}: {_describe(e)}") from e


def _describe(error: httpx2.TransportError) -> str:
    if isinstance(error, httpx2.ConnectError):
        return f"cannot connect ({error})"
    if isinstance(error, httpx2.RemoteProtocolError):
        return f"connection broken before the answer was complete ({error})"
    return f"{type(error).__name__}: {error}"


def _iter_bytes(response: httpx2.Response) -> Iterator[bytes]:
    # no chunk_size: no re-buffering, each chunk is what one socket read returned
    yield from response.iter_bytes()


def _read_all(response: httpx2.Response) -> bytes:
    return b"".join(_iter_bytes(response))


def _json(response: httpx2.Response) -> Any:
    response.read()
    try:
        return response.json()
    except ValueError as e:
        raise OmniError(
            f"{response.request.url}: expected JSON, got {response.headers.get('content-type')}"
        ) from e
