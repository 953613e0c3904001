"""The request kinds of `omni-bench soak --mix`, on the embedded repository's models: each sends
one request and returns its outcome ("200 ok", "<status> <code>", "realtime <status>").

A body is read whole (a stream cut midway raises: the soak counts it as cut); a realtime
request is one session: a text item, one spoken answer (up to `response.done`), then close. A
refused `response.create` (no admission place, a model restarting) gets an `error` event and no
`response.done`: that ends the session too, as "realtime error <code>". Every server event is
awaited at most EVENT_TIMEOUT_S: a session that hears nothing for that long is counted as cut
(what the soak is there to find), never waited on forever.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Awaitable, Callable

import aiohttp

TEXT = "The quick brown fox jumps over the lazy dog."
QUESTION = "Name a primary color."
EVENT_TIMEOUT_S = 120.0  # as the HTTP kinds' whole-request bound


async def speech_clip(http: aiohttp.ClientSession, url: str) -> bytes:
    """A WAV of TEXT from the server's own voice: what the transcription requests send."""
    body = {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "wav"}
    async with http.post(f"{url}/v1/audio/speech", json=body) as r:
        r.raise_for_status()
        return await r.read()


async def _outcome(r: aiohttp.ClientResponse) -> str:
    if r.status == 200:
        await r.read()
        return "200 ok"
    try:
        code = (await r.json()).get("error", {}).get("code")
    except (aiohttp.ContentTypeError, json.JSONDecodeError):
        code = "(not JSON)"
    return f"{r.status} {code}"


async def speech(http: aiohttp.ClientSession, url: str, clip: bytes) -> str:
    body = {"model": "tts-1", "voice": "alloy", "input": TEXT, "response_format": "pcm"}
    async with http.post(f"{url}/v1/audio/speech", json=body) as r:
        return await _outcome(r)


async def transcription(http: aiohttp.ClientSession, url: str, clip: bytes) -> str:
    form = aiohttp.FormData()
    form.add_field("model", "whisper-1")
    form.add_field("file", clip, filename="soak.wav", content_type="audio/wav")
    async with http.post(f"{url}/v1/audio/transcriptions", data=form) as r:
        return await _outcome(r)


async def chat(http: aiohttp.ClientSession, url: str, clip: bytes) -> str:
    body = {"model": "smol-chat", "messages": [{"role": "user", "content": QUESTION}]}
    async with http.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 24}) as r:
        return await _outcome(r)


async def omni(http: aiohttp.ClientSession, url: str, clip: bytes) -> str:
    body = {
        "model": "smol-omni",
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 24,
        "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "wav"},
    }
    async with http.post(f"{url}/v1/chat/completions", json=body) as r:
        return await _outcome(r)


async def realtime(http: aiohttp.ClientSession, url: str, clip: bytes) -> str:
    ws_url = url.replace("http://", "ws://") + "/v1/realtime?model=smol-realtime"
    try:
        ws = await http.ws_connect(ws_url, max_msg_size=0)
    except aiohttp.WSServerHandshakeError as err:
        return f"{err.status} (upgrade refused)"
    async with ws:
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": QUESTION}],
        }
        await ws.send_str(
            json.dumps({"type": "session.update", "session": {"max_output_tokens": 24}})
        )
        await ws.send_str(json.dumps({"type": "conversation.item.create", "item": item}))
        await ws.send_str(json.dumps({"type": "response.create"}))
        audio = 0
        while True:
            message = await ws.receive(timeout=EVENT_TIMEOUT_S)  # TimeoutError: counted as cut
            if message.type != aiohttp.WSMsgType.TEXT:
                break
            event = json.loads(message.data)
            if event["type"] == "response.output_audio.delta":
                audio += len(base64.b64decode(event["delta"]))
            elif event["type"] == "error":
                return f"realtime error {event['error'].get('code')}"
            elif event["type"] == "response.done":
                status = event["response"]["status"]
                return f"realtime {status}" + (
                    "" if audio or status != "completed" else " (no audio)"
                )
        return "cut: the socket closed before response.done"


REQUESTS: dict[str, Callable[[aiohttp.ClientSession, str, bytes], Awaitable[str]]] = {
    "speech": speech,
    "transcription": transcription,
    "chat": chat,
    "omni": omni,
    "realtime": realtime,
}
