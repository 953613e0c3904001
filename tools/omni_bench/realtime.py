"""`omni-bench realtime`: voice-to-voice latency over GET /v1/realtime, split into its hops.

A question spoken by the embedded voice is sent at real-time pace (100 ms chunks) with silence
after it; the server's VAD ends the turn. Per turn:

  turn detection  end of speech in the sent audio -> input_audio_buffer.speech_stopped
                  (includes the configured silence_duration_ms)
  ASR             committed -> ...input_audio_transcription.completed
  thinker         transcription completed -> the first complete sentence of the transcript
  voice           first complete sentence -> first answer audio byte
  voice-to-voice  end of speech -> first answer audio byte

against the floors measured alone in the same run (one request at a time, over HTTP): Whisper on
the question, the thinker's first sentence (chat, streamed), the voice's first audio of that
sentence (speech, streamed pcm). Barge-in: speech sent over a playing answer -> response.done.

    python -m omni_bench.realtime [--url URL] [--sessions 1,4,8] [--turns 3]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import re
import statistics
import sys
import time
import wave
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from omni_bench.harness import tables
from omni_bench.harness.server import OmniServer
from omni_bench.harness.timing import percentile

MODEL = "smol-realtime"
QUESTION = "What is the capital of France?"
INSTRUCTIONS = "Answer in one short sentence."
RATE = 24_000
CHUNK_S = 0.1
SILENCE_MS = 500  # the session's silence_duration_ms
SENTENCE_END = re.compile(r"[.!?](\s|$)")


@dataclass
class Turn:
    end_of_speech: float = 0.0
    events: dict[str, float] = field(default_factory=dict)  # first time of each event type
    first_sentence: float | None = None
    transcript: str = ""

    def hops(self) -> dict[str, float]:
        e = self.events
        first_audio = e["response.output_audio.delta"]
        sentence = self.first_sentence or first_audio
        return {
            "turn": e["input_audio_buffer.speech_stopped"] - self.end_of_speech,
            "asr": e[_TRANSCRIBED] - e["input_audio_buffer.committed"],
            "thinker": sentence - e[_TRANSCRIBED],
            "voice": first_audio - sentence,
            "v2v": first_audio - self.end_of_speech,
        }


_TRANSCRIBED = "conversation.item.input_audio_transcription.completed"


async def _session(
    http: aiohttp.ClientSession, url: str, pcm: bytes, speech_end_s: float, turns: int
) -> list[Turn]:
    out = []
    async with http.ws_connect(f"{url}/v1/realtime?model={MODEL}", max_msg_size=1 << 26) as ws:
        await ws.receive_json()  # session.created
        update = {
            "type": "session.update",
            "session": {
                "type": "realtime",
                "instructions": INSTRUCTIONS,
                "max_output_tokens": 48,
                "audio": {
                    "input": {
                        "turn_detection": {"type": "server_vad", "silence_duration_ms": SILENCE_MS}
                    }
                },
            },
        }
        await ws.send_str(json.dumps(update))
        await ws.receive_json()  # session.updated
        for _ in range(turns):
            turn = Turn()
            sender = asyncio.create_task(_send_paced(ws, pcm, speech_end_s, turn))
            async for event in _events(ws):
                kind = event["type"]
                turn.events.setdefault(kind, time.perf_counter())
                if kind == "response.output_audio_transcript.delta":
                    turn.transcript += event["delta"]
                    if turn.first_sentence is None and SENTENCE_END.search(turn.transcript):
                        turn.first_sentence = time.perf_counter()
                if kind == "response.done":
                    break
            await sender
            out.append(turn)
    return out


async def _send_paced(ws, pcm: bytes, speech_end_s: float, turn: Turn) -> None:
    step = int(RATE * CHUNK_S) * 2
    start = time.perf_counter()
    for i, offset in enumerate(range(0, len(pcm), step)):
        await asyncio.sleep(max(0.0, start + i * CHUNK_S - time.perf_counter()))
        chunk = base64.b64encode(pcm[offset : offset + step]).decode()
        await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": chunk}))
        if not turn.end_of_speech and (i + 1) * CHUNK_S >= speech_end_s:
            turn.end_of_speech = time.perf_counter()


async def _events(ws) -> AsyncIterator[dict]:
    async for message in ws:
        if message.type != aiohttp.WSMsgType.TEXT:
            raise RuntimeError(f"the socket ended: {message.type}")
        event = json.loads(message.data)
        if event["type"] == "error":
            raise RuntimeError(f"server error event: {event['error']}")
        yield event


async def _floors(
    http: aiohttp.ClientSession, url: str, question_wav: bytes, answer: str
) -> dict[str, float]:
    """Each hop alone, one request at a time: the medians of three runs."""
    runs: dict[str, list[float]] = {"asr": [], "thinker": [], "voice": []}
    sentence = SENTENCE_END.split(answer)[0] + "." if answer else "Paris is the capital."
    for _ in range(3):
        form = aiohttp.FormData()
        form.add_field("file", question_wav, filename="q.wav")
        form.add_field("model", "whisper-1")
        t = time.perf_counter()
        async with http.post(f"{url}/v1/audio/transcriptions", data=form) as r:
            await r.read()
        runs["asr"].append(time.perf_counter() - t)
        body = {
            "model": "smol-chat",
            "stream": True,
            "max_tokens": 48,
            "messages": [
                {"role": "system", "content": INSTRUCTIONS},
                {"role": "user", "content": QUESTION},
            ],
        }
        t, text = time.perf_counter(), ""
        async with http.post(f"{url}/v1/chat/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                    text += delta
                    if SENTENCE_END.search(text):
                        break
        runs["thinker"].append(time.perf_counter() - t)
        body = {
            "model": "tts-1",
            "voice": "alloy",
            "input": sentence,
            "response_format": "pcm",
            "stream_format": "audio",
        }
        t = time.perf_counter()
        async with http.post(f"{url}/v1/audio/speech", json=body) as r:
            await r.content.readany()
            runs["voice"].append(time.perf_counter() - t)
            await r.read()
    return {k: statistics.median(v) for k, v in runs.items()}


async def _barge_in(http: aiohttp.ClientSession, url: str, pcm: bytes) -> float:
    """Speech over a playing answer: from the speech's first chunk sent to response.done."""
    async with http.ws_connect(f"{url}/v1/realtime?model={MODEL}", max_msg_size=1 << 26) as ws:
        await ws.receive_json()
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Tell me a long story about a dragon."}],
        }
        await ws.send_str(json.dumps({"type": "conversation.item.create", "item": item}))
        await ws.send_str(
            json.dumps({"type": "response.create", "response": {"max_output_tokens": 200}})
        )
        async for event in _events(ws):
            if event["type"] == "response.output_audio.delta":
                break
        turn = Turn()  # the question starts after 1 s of silence
        sender = asyncio.create_task(_send_paced(ws, pcm, 1.0, turn))
        async for event in _events(ws):
            if event["type"] == "response.done":
                done = time.perf_counter()
                break
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
        return done - turn.end_of_speech


async def run(url: str, levels: list[int], turns: int) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
        body = {
            "model": "tts-1",
            "voice": "alloy",
            "input": QUESTION,
            "response_format": "pcm",
            "stream_format": "audio",
        }
        async with http.post(f"{url}/v1/audio/speech", json=body) as r:
            speech = await r.read()
        silence = bytes(RATE * 2)
        pcm = silence + speech + silence * 2
        speech_end_s = 1.0 + len(speech) / (2 * RATE)
        columns = ["sessions", "turns", "v2v p50 ms", "v2v p95 ms", "turn ms", "ASR ms"]
        lines = tables.header([*columns, "thinker ms", "voice ms"], "r" * 8)
        answer = ""
        for n in levels:
            sessions = (_session(http, url, pcm, speech_end_s, turns) for _ in range(n))
            results = await asyncio.gather(*sessions)
            hops = [t.hops() for session in results for t in session]
            answer = answer or results[0][0].transcript
            med = {k: statistics.median(h[k] for h in hops) * 1000 for k in hops[0]}
            v2v = [h["v2v"] * 1000 for h in hops]
            by_hop = (f"{med[k]:.0f}" for k in ("turn", "asr", "thinker", "voice"))
            v2v_cells = (f"{percentile(v2v, p):.0f}" for p in (50, 95))
            lines.append(tables.row([n, len(hops), *v2v_cells, *by_hop]))
        floors = await _floors(http, url, _wav(speech), answer)
        barge = [await _barge_in(http, url, pcm) for _ in range(3)]
    total = SILENCE_MS / 1000 + sum(floors.values())
    lines += [
        "",
        f"floors alone (medians of 3): ASR {floors['asr'] * 1000:.0f} ms, thinker first sentence "
        f"{floors['thinker'] * 1000:.0f} ms, voice first audio {floors['voice'] * 1000:.0f} ms; "
        f"+ silence {SILENCE_MS} ms = {total * 1000:.0f} ms",
        "barge-in (end of the interrupting speech's first chunk -> response.done), 3 runs: "
        + ", ".join(f"{b * 1000:.0f} ms" for b in barge),
    ]
    return "\n".join(lines)


async def _served(repo: Path, levels: list[int], turns: int) -> str:
    """`run` against omni-server on `repo`, started here and checked to leave nothing behind."""
    server = OmniServer(repo, ready_timeout_s=600)
    try:
        await server.start()
    except RuntimeError as err:
        raise SystemExit(f"omni-bench realtime: {err}") from None
    try:
        return await run(server.url, levels, turns)
    finally:
        await server.stop(check=True)


def _wav(pcm: bytes) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="omni-bench realtime", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--url", help="a running server (default: start one on --repo)")
    parser.add_argument("--repo", type=Path, default=Path("repository"), help="repository to serve")
    parser.add_argument("--sessions", default="1,4,8", help="concurrent sessions per level")
    parser.add_argument("--turns", type=int, default=3, help="spoken turns per session")
    args = parser.parse_args(argv)
    try:
        levels = [int(x) for x in args.sessions.split(",")]
    except ValueError:
        parser.error(f"--sessions must be integers separated by commas, got {args.sessions!r}")
    if args.url:
        print(asyncio.run(run(args.url.rstrip("/"), levels, args.turns)))
    else:
        print(asyncio.run(_served(args.repo, levels, args.turns)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
