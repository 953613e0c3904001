"""`OmniClient`: the blocking client, on one pooled httpx2 connection set (keep-alive reuse)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2

from omni_client import errors, protocol


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
        with self._send(request) as response:
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
        with self._send(request) as response:
            for data in _iter_bytes(response):
                if chunk := aligner.feed(data):
                    yield chunk
        aligner.finish()

    # -- discovery -----------------------------------------------------------------------------

    def models(self) -> list[dict[str, Any]]:
        """The served models (`GET /v1/models`): dicts with at least `id`."""
        return self._json(protocol.MODELS)["data"]

    def health(self) -> dict[str, Any]:
        """`GET /health`: the server's status JSON; an `APIError` while it is not ready."""
        return self._json(protocol.HEALTH)

    # -- transport -----------------------------------------------------------------------------

    @contextmanager
    def _send(self, request: protocol.Request) -> Iterator[httpx2.Response]:
        """An open, successful streaming response; transport failures become typed errors."""
        with (
            _translated_errors(self.base_url),
            self._http.stream(request.method, request.path, json=request.json) as response,
        ):
            if response.status_code >= 400:
                raise errors.APIError.from_body(
                    response.status_code, response.read(), response.reason_phrase
                )
            yield response

    def _json(self, request: protocol.Request) -> Any:
        with self._send(request) as response:
            return protocol.decode_json(
                _read_all(response),
                url=str(response.request.url),
                content_type=response.headers.get("content-type"),
            )


@contextmanager
def _translated_errors(url: str) -> Iterator[None]:
    try:
        yield
    except httpx2.TimeoutException as e:
        raise errors.timed_out(url, e) from e
    except httpx2.ConnectError as e:
        raise errors.cannot_connect(url, e) from e
    except httpx2.RemoteProtocolError as e:
        raise errors.broken_off(url, str(e)) from e
    except httpx2.TransportError as e:
        raise errors.OmniConnectionError(f"{url}: {type(e).__name__}: {e}") from e


def _iter_bytes(response: httpx2.Response) -> Iterator[bytes]:
    # no chunk_size: no re-buffering, each chunk is what one socket read returned
    yield from response.iter_bytes()


def _read_all(response: httpx2.Response) -> bytes:
    return b"".join(_iter_bytes(response))
