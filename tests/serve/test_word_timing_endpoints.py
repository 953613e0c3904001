"""The voice's word timings on every transport, against the real server on the embedded
repository: `/v1/audio/speech` with `timestamps` (one JSON body, or a word event per word in
the SSE stream; the default response unchanged), the stream-input WebSocket's ElevenLabs
`alignment`, and realtime's `words` on transcript deltas, with a barge-in's truncate cutting
the transcript at the word that was playing."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import wave

import aiohttp
import httpx
import pytest
from openai import AsyncOpenAI

from omni_server.contracts import WordTiming
from omni_server.serve import speech_stream
from omni_server.serve.realtime.conversation import heard_transcript

TEXT = "The quick brown fox jumps over the lazy dog. Then it sleeps."
WORDS = TEXT.replace(".", "").split()


def _speech(server, **fields) -> httpx.Response:
    body = {"model": "tts-1", "voice": "alloy", "input": TEXT, "seed": 5, **fields}
    return httpx.post(server.url + "/v1/audio/speech", json=body, timeout=120)


@pytest.mark.slow
def test_timestamps_without_a_stream_are_one_json_body(server):
    response = _speech(server, response_format="wav", timestamps=True)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    with wave.open(io.BytesIO(base64.b64decode(body["audio_base64"]))) as w:
        seconds = w.getnframes() / w.getframerate()
    alignment = body["alignment"]
    assert "".join(alignment["characters"]) == TEXT
    starts = alignment["character_start_times_seconds"]
    ends = alignment["character_end_times_seconds"]
    assert len(starts) == len(ends) == len(TEXT) and starts == sorted(starts)
    assert ends[-1] == pytest.approx(seconds, abs=0.002)  # the "." ends with the audio
    assert body["normalized_alignment"] == alignment
    assert [w["word"] for w in body["words"]] == WORDS
    assert all(0 <= w["start"] < w["end"] <= seconds for w in body["words"])


@pytest.mark.slow
def test_sse_sends_each_word_after_the_audio_that_speaks_it(server):
    response = _speech(server, response_format="pcm", stream_format="sse", timestamps=True)
    assert response.status_code == 200, response.text
    events = [
        json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:")
    ]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "speech.audio.delta" and kinds[-1] == "speech.audio.done"
    words = [e for e in events if e["type"] == "speech.audio.word"]
    assert [w["word"] for w in words] == WORDS
    starts = [w["start"] for w in words]
    assert starts == sorted(starts)
    # a word's event never comes before audio that reaches its start
    heard = 0.0
    for event in events:
        if event["type"] == "speech.audio.delta":
            heard += len(base64.b64decode(event["audio"])) / (2 * 24000)
        elif event["type"] == "speech.audio.word":
            assert event["start"] <= heard, (event, heard)


@pytest.mark.slow
def test_the_default_response_is_unchanged_and_raw_audio_refuses_timestamps(server):
    plain = _speech(server, response_format="pcm")
    assert plain.headers["content-type"] == "audio/pcm" and len(plain.content) > 24000
    refused = _speech(server, response_format="pcm", stream_format="audio", timestamps=True)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "timestamps"


@pytest.mark.slow
async def test_stream_input_sends_elevenlabs_alignment_with_each_chunk(server):
    url = f"{server.url}{speech_stream.PATH}?model=tts-1&voice=alloy&seed=7"
    chars: list[str] = []
    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        await ws.send_str(json.dumps({"text": " "}))
        await ws.send_str(json.dumps({"text": TEXT + " "}))
        await ws.send_str(json.dumps({"text": ""}))
        while True:
            event = json.loads((await ws.receive(timeout=120)).data)
            assert "error" not in event, event
            if event.get("isFinal"):
                break
            alignment = event["alignment"]
            if alignment is None:
                continue
            assert alignment == event["normalizedAlignment"]
            assert len(alignment["chars"]) == len(alignment["charStartTimesMs"])
            assert len(alignment["chars"]) == len(alignment["charDurationsMs"])
            assert all(t >= 0 for t in alignment["charStartTimesMs"])
            chars += alignment["chars"]
    assert "".join(chars).split() == TEXT.split()


def _timing(*spans: tuple[str, float, float]) -> list[WordTiming]:
    words, at = [], 0
    for text, start, end in spans:
        words.append(WordTiming(text, start, end, at, at + len(text)))
        at += len(text) + 1
    return words


def test_a_truncate_keeps_the_transcript_to_the_word_playing():
    words = _timing(
        ("Hello", 0.1, 0.4), ("there,", 0.5, 0.8), ("my", 0.9, 1.0), ("friend", 1.1, 1.5)
    )
    transcript = "Hello there, my friend."
    assert heard_transcript(transcript, words, 50) == ""  # before the first word
    assert heard_transcript(transcript, words, 300) == "Hello"
    assert heard_transcript(transcript, words, 450) == "Hello"  # the pause after it
    assert heard_transcript(transcript, words, 600) == "Hello there,"
    assert heard_transcript(transcript, words, 1600) == transcript
    assert heard_transcript(transcript, [], 600) is None  # no timings: the caller's share rule
    # a spoken word the transcript does not hold ("5 dollars" for "$5") leaves the cut before
    spoken = _timing(("It", 0.0, 0.2), ("costs", 0.3, 0.6), ("5", 0.7, 0.9), ("dollars", 1.0, 1.4))
    assert heard_transcript("It costs $5 today.", spoken, 1200) == "It costs $5"


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_barge_in_truncates_the_transcript_at_the_word_playing(server):
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    async with client.realtime.connect(model="smol-realtime") as conn:
        await conn.session.update(
            session={
                "type": "realtime",
                "instructions": "Answer in two sentences.",
                "seed": 7,
            }
        )
        await conn.conversation.item.create(
            item={
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Tell me about the sea."}],
            }
        )
        await conn.response.create()
        words: list[dict] = []
        item_id, full = None, ""

        async def until_done() -> None:
            nonlocal item_id, full
            async for event in conn:
                if event.type == "response.output_audio_transcript.done":
                    full = event.transcript
                if event.type == "response.output_audio_transcript.delta":
                    item_id = event.item_id
                    words.extend((event.model_extra or {}).get("words") or [])
                if event.type == "response.done":
                    return

        await asyncio.wait_for(until_done(), 300)
        assert len(words) >= 4, words
        playing = words[len(words) // 2]  # the user spoke in the middle of this word
        end_ms = (playing["start_ms"] + playing["end_ms"]) // 2
        await conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=end_ms)
        await conn.conversation.item.retrieve(item_id=item_id)
        async for event in conn:
            if event.type == "conversation.item.retrieved":
                transcript = event.item.content[0].transcript
                break
    said = words[len(words) // 2]["word"]
    # the transcript ends with the word that was playing (and its punctuation): no later word
    assert full.startswith(transcript) and len(transcript) < len(full), (transcript, full)
    assert transcript.rstrip(".,;:!?").endswith(said), (transcript, said)
