"""Text piped in as it is written, audio out as each sentence is spoken, over
`GET /v1/audio/speech/stream-input` (docs/stream_input.md).

The text is read as it arrives (a language model's tokens through a pipe, not whole lines) and
sent as deltas; the end of the input is the protocol's end message. Audio comes back as raw
binary PCM16 frames, handed to `on_audio` as they arrive, until the server's `isFinal`.
"""

from __future__ import annotations

import asyncio
import codecs
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO
from urllib.parse import urlencode

import aiohttp

from omni_client import protocol
from omni_client.errors import APIError, OmniError

PATH = "/v1/audio/speech/stream-input"
READ_BYTES = 4096


@dataclass
class Spoken:
    audio_bytes: int = 0
    sent_chars: int = 0
    final: bool = False


async def speak_stream(
    source: BinaryIO,
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    model: str = protocol.DEFAULT_MODEL,
    voice: str = protocol.DEFAULT_VOICE,
    sample_rate: int = 24_000,
    seed: int | None = None,
    timeout: float = protocol.DEFAULT_TIMEOUT_S,
    on_audio: Callable[[bytes], None] = lambda data: None,
) -> Spoken:
    """Stream `source`'s text (UTF-8) to the server and hand each audio frame to `on_audio`.
    Raises APIError for an error the server sends, OmniError when the session breaks."""
    url = (base_url or protocol.DEFAULT_URL).rstrip("/").replace("http", "ws", 1)
    settings: dict[str, str | int] = {
        "model": model,
        "voice": voice,
        "output_format": f"pcm_{sample_rate}",
    }
    if seed is not None:  # same seed, same text: bit-identical audio
        settings["seed"] = seed
    query = urlencode(settings)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    spoken = Spoken()
    client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout)
    try:
        async with (
            aiohttp.ClientSession(timeout=client_timeout) as http,
            http.ws_connect(f"{url}{PATH}?{query}", headers=headers) as ws,
        ):
            await ws.send_str(json.dumps({"text": " ", "binary": True}))
            sender = asyncio.create_task(_send_text(ws, source, spoken))
            try:
                await _receive_audio(ws, spoken, on_audio, timeout)
            finally:
                sender.cancel()
                await asyncio.gather(sender, return_exceptions=True)
    except aiohttp.WSServerHandshakeError as err:
        refusal = await _refusal(f"{base_url or protocol.DEFAULT_URL}{PATH}?{query}", headers, err)
        raise refusal from None
    except aiohttp.ClientError as err:
        raise OmniError(f"cannot stream to {url}: {err}") from None
    if not spoken.final:
        raise OmniError("the server closed the stream before its end (no isFinal)")
    return spoken


async def _send_text(ws: aiohttp.ClientWebSocketResponse, source: BinaryIO, spoken: Spoken) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    read = getattr(source, "read1", source.read)
    while True:
        data = await asyncio.to_thread(read, READ_BYTES)
        text = decoder.decode(data, final=not data)
        if text:
            spoken.sent_chars += len(text)
            await ws.send_str(json.dumps({"text": text}))
        if not data:
            await ws.send_str(json.dumps({"text": ""}))  # the end: speak what is left
            return


async def _receive_audio(
    ws: aiohttp.ClientWebSocketResponse,
    spoken: Spoken,
    on_audio: Callable[[bytes], None],
    timeout: float,
) -> None:
    while True:
        message = await ws.receive()  # audio may pause while the text does: no timeout here
        if message.type == aiohttp.WSMsgType.BINARY:
            spoken.audio_bytes += len(message.data)
            on_audio(message.data)
        elif message.type == aiohttp.WSMsgType.TEXT:
            event = json.loads(message.data)
            _check(event)
            if event.get("isFinal") is True:
                spoken.final = True
                return
        else:
            return  # closed: `final` tells whether it ended well


async def _refusal(
    url: str, headers: dict[str, str], err: aiohttp.WSServerHandshakeError
) -> APIError:
    """The refused upgrade's reason: the server checks the settings before the upgrade, so a
    plain GET of the same URL answers the same error with its JSON body."""
    message = f"the server refused the stream ({err.status})"
    try:
        async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as answer:
            error = (await answer.json(content_type=None)).get("error") or {}
    except (aiohttp.ClientError, ValueError, AttributeError):
        return APIError(err.status, message)
    return APIError(
        err.status,
        str(error.get("message", message)),
        param=error.get("param"),
        code=error.get("code"),
    )


def _check(event: Any) -> None:
    if isinstance(event, dict) and isinstance(event.get("error"), dict):
        error = event["error"]
        status = 400 if error.get("type") == "invalid_request_error" else 500
        raise APIError(
            status,
            str(error.get("message", "the server sent an error")),
            param=error.get("param"),
            code=error.get("code"),
        )
