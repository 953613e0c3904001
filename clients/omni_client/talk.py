"""One spoken turn over `GET /v1/realtime`: send a recording, hear the answer.

The recording (a WAV file, any rate, mono or stereo) is sent as 24 kHz PCM16 in 100 ms events,
followed by silence so the server's voice-activity detection ends the turn; the transcripts
(the question as heard, the answer as it is spoken) go to stderr as they arrive, and the
answer's audio to a WAV file or, raw, to stdout.
"""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
import soxr

from omni_client import protocol
from omni_client.errors import APIError, OmniError, OmniUsageError

RATE = 24_000
CHUNK_BYTES = RATE // 10 * 2  # 100 ms of PCM16
TRAILING_SILENCE_S = 1.5  # ends the turn for the server's VAD (its default is 500 ms)


@dataclass
class Turn:
    heard: str = ""  # the question, as the server transcribed it
    answer: str = ""  # the answer's transcript
    audio: bytearray = field(default_factory=bytearray)  # PCM16, 24 kHz, mono
    status: str = ""


def read_wav(data: bytes) -> bytes:
    """A WAV file's samples as 24 kHz mono PCM16. Raises OmniUsageError if it is no PCM WAV."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as err:
        raise OmniUsageError(f"not a PCM WAV file: {err}") from None
    if width != 2:
        raise OmniUsageError(f"the WAV file must be 16-bit PCM, it has {8 * width}-bit samples")
    samples = np.frombuffer(frames, "<i2").astype(np.float32).reshape(-1, channels).mean(axis=1)
    if rate != RATE:
        samples = soxr.resample(samples, rate, RATE)
    return np.clip(np.round(samples), -32768, 32767).astype("<i2").tobytes()


async def talk(
    pcm: bytes,
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    model: str = "smol-realtime",
    instructions: str | None = None,
    timeout: float = protocol.DEFAULT_TIMEOUT_S,
    on_event: Callable[[str, str], None] = lambda kind, text: None,
    on_audio: Callable[[bytes], None] = lambda data: None,
) -> Turn:
    """Send one spoken turn and collect the answer. `on_event(kind, text)` sees "heard" (the
    question's transcript) and "answer" (each delta of the answer's transcript); `on_audio`
    each block of the answer's audio as it arrives."""
    url = (base_url or protocol.DEFAULT_URL).rstrip("/").replace("http", "ws", 1)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    turn = Turn()
    client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout)
    try:
        async with (
            aiohttp.ClientSession(timeout=client_timeout) as http,
            http.ws_connect(
                f"{url}/v1/realtime?model={model}", headers=headers, max_msg_size=1 << 26
            ) as ws,
        ):
            await _expect(ws, "session.created", timeout)
            if instructions is not None:
                session = {"type": "realtime", "instructions": instructions}
                await ws.send_str(json.dumps({"type": "session.update", "session": session}))
            silence = bytes(int(RATE * TRAILING_SILENCE_S) * 2)
            for start in range(0, len(pcm) + len(silence), CHUNK_BYTES):
                block = (pcm + silence)[start : start + CHUNK_BYTES]
                event = {
                    "type": "input_audio_buffer.append",
                    "audio": base64.b64encode(block).decode(),
                }
                await ws.send_str(json.dumps(event))
            while not turn.status:
                event = await _receive(ws, timeout)
                _on(event, turn, on_event, on_audio)
    except aiohttp.WSServerHandshakeError as err:
        raise APIError(err.status, f"the server refused the session: {err.message}") from None
    except aiohttp.ClientError as err:
        raise OmniError(f"cannot talk to {url}: {err}") from None
    return turn


def _on(
    event: dict[str, Any],
    turn: Turn,
    on_event: Callable[[str, str], None],
    on_audio: Callable[[bytes], None],
) -> None:
    kind = event.get("type")
    if kind == "error":
        error = event.get("error") or {}
        message = str(error.get("message", "the server sent an error"))
        raise APIError(400, message, param=error.get("param"), code=error.get("code"))
    if kind == "conversation.item.input_audio_transcription.completed":
        turn.heard = str(event.get("transcript", ""))
        on_event("heard", turn.heard)
    elif kind in ("response.output_audio_transcript.delta", "response.audio_transcript.delta"):
        turn.answer += event["delta"]
        on_event("answer", event["delta"])
    elif kind in ("response.output_audio.delta", "response.audio.delta"):
        data = base64.b64decode(event["delta"])
        turn.audio += data
        on_audio(data)
    elif kind == "response.done":
        turn.status = str(event["response"]["status"])


async def _expect(ws: aiohttp.ClientWebSocketResponse, kind: str, timeout: float) -> None:
    event = await _receive(ws, timeout)
    if event.get("type") != kind:
        raise OmniError(f"expected {kind}, the server sent {event.get('type')!r}")


async def _receive(ws: aiohttp.ClientWebSocketResponse, timeout: float) -> dict[str, Any]:
    message = await ws.receive(timeout=timeout)
    if message.type != aiohttp.WSMsgType.TEXT:
        raise OmniError(f"the server closed the session ({message.type.name})")
    event = json.loads(message.data)
    if not isinstance(event, dict):
        raise OmniError("the server sent an event that is not a JSON object")
    return event


def wav_bytes(pcm: bytes) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm)
    return out.getvalue()
