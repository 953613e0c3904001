"""`OmniClient`: the blocking client, on one pooled httpx2 connection set (keep-alive reuse).

`AsyncOmniClient` (async_client.py) is its line-for-line asyncio twin on the same library:
requests are built and answers decoded by `protocol`, errors translated by `errors.translated`.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2

from omni_client import errors, protocol, transport


class OmniClient:
    """Blocking client for an omni-server (or any OpenAI-audio-compatible server).

    `timeout` bounds each wait (connecting, sending, and the gap between received bytes), not
    the whole request. `api_key` (default: $OMNI_API_KEY) is sent as a Bearer token.
    Thread-safe; reuse one instance so that connections are kept alive. Close it, or use it as
    a context manager.
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
        self._http = httpx2.Client(
            **transport.client_options(self.base_url, api_key, timeout, max_connections)
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
        with self._send(request) as response:
            return response.read()

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
        voice: str = protocol.DEFAULT_VOICE,
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
            for data in response.iter_bytes():  # no chunk_size: each read as it came
                if chunk := aligner.feed(data):
                    yield chunk
        aligner.finish()

    def stream_words(
        self,
        text: str,
        *,
        model: str = protocol.DEFAULT_MODEL,
        voice: str = protocol.DEFAULT_VOICE,
        speed: float | None = None,
        seed: int | None = None,
        instructions: str | None = None,
        sample_rate: int | None = None,
    ) -> Iterator[bytes | dict[str, Any]]:
        """Raw s16le mono PCM chunks (bytes, as `stream_pcm`) and, after the chunk that speaks
        them, the words: `{"word", "start", "end"}`, seconds from the audio's start (the
        server's `timestamps` extension; a voice that times nothing sends none). A stream cut
        before its done event raises (`OmniError`)."""
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
            timestamps=True,
        )
        aligner = protocol.SampleAligner()
        with self._send(request) as response:
            url = str(response.request.url)
            events = protocol.SseEvents(url)
            done = False
            for data in response.iter_bytes():
                for event in events.feed(data):
                    if event["type"] == protocol.AUDIO_DELTA:
                        if chunk := aligner.feed(base64.b64decode(event["audio"])):
                            yield chunk
                    elif event["type"] == protocol.WORD_EVENT:
                        yield {k: event[k] for k in ("word", "start", "end")}
                    elif event["type"] == protocol.AUDIO_DONE:
                        done = True
            events.finish()
            if not done:
                raise errors.OmniError(f"{url}: the stream ended before {protocol.AUDIO_DONE}")
        aligner.finish()

    # -- transcription -------------------------------------------------------------------------

    def transcribe(
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
        """The transcript of an audio file (a path, its bytes, or a binary file object): the
        JSON object for `json` / `verbose_json`, the text for `text`, `srt` and `vtt`.
        `timestamp_granularities` ("segment", "word") needs `verbose_json`."""
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
        with self._send(request) as response:
            return protocol.decode_transcript(
                response.read(),
                response_format,
                url=str(response.request.url),
                content_type=response.headers.get("content-type"),
            )

    def stream_transcription(
        self,
        file: protocol.AudioFile,
        *,
        model: str = protocol.DEFAULT_TRANSCRIPTION_MODEL,
        language: str | None = None,
        prompt: str | None = None,
        temperature: float | None = None,
        filename: str | None = None,
    ) -> Iterator[dict[str, Any]]:
        """The transcript as it is heard: OpenAI's events, `{"type": "transcript.text.delta",
        "delta": ...}` as text is recognized, then `{"type": "transcript.text.done", "text":
        ...}`. A stream cut before its done event raises (`OmniError`)."""
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
        with self._send(request) as response:
            url = str(response.request.url)
            events, transcript = protocol.SseEvents(url), protocol.TranscriptStream(url)
            for data in response.iter_bytes():
                for event in events.feed(data):
                    yield transcript.check(event)
            events.finish()
            transcript.finish()

    # -- discovery -----------------------------------------------------------------------------

    def models(self) -> list[dict[str, Any]]:
        """The served models (`GET /v1/models`): dicts with at least `id`."""
        return self._json(protocol.MODELS)["data"]

    def health(self) -> dict[str, Any]:
        """`GET /health`: the server's status JSON; an `APIError` while it is not ready."""
        return self._json(protocol.HEALTH)

    def repository_index(self, *, ready: bool = False) -> list[dict[str, Any]]:
        """Every model of the server's repository (`POST /v2/repository/index`): dicts with
        `name`, `state` (READY, UNAVAILABLE, LOADING, UNLOADING), `reason`, and `version`
        while loaded; `ready`: only READY ones."""
        return self._json(protocol.repository_index(ready=ready))

    def load_model(self, name: str, config: dict[str, Any] | None = None) -> None:
        """Load or reload `name` (an atomic swap: returns once the new version serves);
        `config` overrides repository fields for it ({"stages.s.parameters.k": 1}). An
        `APIError` (400, 404, 500 with the reason) when it fails; the old version serves on."""
        self._call(protocol.load_model(name, config))

    def unload_model(self, name: str, *, unload_dependents: bool = False) -> None:
        """Unload `name` once its running requests finished (with `unload_dependents`, every
        model sharing a stage with it too)."""
        self._call(protocol.unload_model(name, unload_dependents=unload_dependents))

    # -- transport -----------------------------------------------------------------------------

    def _call(self, request: protocol.Request) -> None:
        with self._send(request) as response:
            response.read()

    @contextmanager
    def _send(self, request: protocol.Request) -> Iterator[httpx2.Response]:
        """An open, successful streaming response; transport failures become typed errors."""
        with (
            errors.translated(self.base_url),
            self._http.stream(request.method, request.path, **transport.body(request)) as response,
        ):
            if response.status_code >= 400:
                raise errors.APIError.from_body(
                    response.status_code, response.read(), response.reason_phrase
                )
            yield response

    def _json(self, request: protocol.Request) -> Any:
        with self._send(request) as response:
            return protocol.decode_json(
                response.read(),
                url=str(response.request.url),
                content_type=response.headers.get("content-type"),
            )
