"""examples/qwen3-omni served over HTTP on a tiny random checkpoint (omni_bench's writer, in
this module's tmp dir), driven with the official `openai` client: the model hears a spoken
question itself (`audio_input = "native"`: the clip reaches the preprocessing stage as a
`contracts.AudioPart`, no transcription model is in the repository) and answers in text and
24 kHz speech, streamed or whole, or in text alone.

The checkpoint's weights are random, so its words are not checked: what is checked is the
path (the clip is heard: it costs prompt tokens; text and audio deltas come interleaved as
OpenAI's client reads them; the audio decodes at 24 kHz; a realtime turn is heard by the model
and answered aloud). The spoken question is a synthetic clip (a 440 Hz tone: a random thinker
cannot tell speech from a tone). Every answer has a fixed length (the thinker and the talker
ignore EOS, up to MAX_TOKENS tokens and SPOKEN_S seconds). Equality with transformers is the
stage tests' (tests/examples/test_qwen3_omni_thinker_served.py, _talker_served.py).
"""

from __future__ import annotations

import asyncio
import base64
import io
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from openai import AsyncOpenAI, OpenAI

from omni_server.audio import decode
from tests.helpers.server import ROOT, ServerProcess

pytest.importorskip("transformers")  # the random checkpoint's writer
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = ROOT / "examples" / "qwen3-omni"
MODEL = "qwen3-omni"
RATE = 16_000
MAX_TOKENS = 8  # a random thinker's words: enough to stream, short for the CPU
SPOKEN_S = 2.0  # the talker's answer: 25 frames of 12.5 a second
OUT_RATE = 24_000


def _clip(seconds: float = 1.0) -> str:
    t = np.arange(int(seconds * RATE)) / RATE
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes((0.3 * np.sin(2 * np.pi * 440.0 * t) * 32767).astype("<i2").tobytes())
    return base64.b64encode(out.getvalue()).decode()


def _question(seconds: float = 1.0) -> list[dict]:
    audio = {"data": _clip(seconds), "format": "wav"}
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Answer the question:"},
                {"type": "input_audio", "input_audio": audio},
            ],
        }
    ]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_bench.random_qwen3_omni import write_qwen3_omni

    return write_qwen3_omni(tmp_path_factory.mktemp("ckpt") / "qwen3-omni", "tiny", seed=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[ServerProcess]:
    """The example as shipped, every answer of fixed length: the thinker says MAX_TOKENS
    tokens, the talker SPOKEN_S seconds (a random checkpoint's EOS comes at random)."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU's fp32 here, even on a GPU host
        server = ServerProcess.start(
            REPO, log, "--parameters.checkpoint", str(checkpoint),
            "--stages.thinker.parameters.ignore_eos", "true",
            "--stages.talker.parameters.ignore_eos", "true",
            "--stages.talker.parameters.max_audio_seconds", str(SPOKEN_S),
        )  # fmt: skip
    with server:
        yield server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[OpenAI]:
    with OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def _ask(client: OpenAI, messages: list[dict], **fields) -> object:
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, **fields
    )


def test_the_model_hears_the_clip(client: OpenAI) -> None:
    """A longer clip costs more prompt tokens: the audio tower's embeddings are in the prompt
    (about 13 a second), so the clip reached the thinker as audio, not as a transcript."""
    short = _ask(client, _question(1.0)).usage.prompt_tokens
    long = _ask(client, _question(3.0)).usage.prompt_tokens
    assert long - short >= 20


def test_a_spoken_question_streams_text_and_audio(client: OpenAI) -> None:
    stream = _ask(
        client,
        _question(),
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"},
        stream=True,
    )
    chunks = list(stream)
    audios = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio]
    assert audios and audios[0].id.startswith("audio_")
    transcript = "".join(a.transcript or "" for a in audios)
    pcm = b"".join(base64.b64decode(a.data) for a in audios if a.data)
    assert transcript  # the thinker's words, as the audio's transcript
    assert len(pcm) / 2 / OUT_RATE == pytest.approx(SPOKEN_S, abs=0.2)  # 24 kHz PCM16
    assert audios[-1].expires_at is not None
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_whole_answer_is_24_khz_speech(client: OpenAI) -> None:
    completion = _ask(
        client, _question(), modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"}
    )
    message = completion.choices[0].message
    assert message.content is None and message.audio.transcript
    data = base64.b64decode(message.audio.data)
    with wave.open(io.BytesIO(data), "rb") as w:
        assert w.getframerate() == OUT_RATE and w.getnchannels() == 1
    clip = decode(data, "wav")
    assert clip.sample_rate == OUT_RATE
    assert clip.samples.size / OUT_RATE == pytest.approx(SPOKEN_S, abs=0.2)


def test_a_text_only_answer_has_no_audio(client: OpenAI) -> None:
    """`speech: None` reaches the thinker, which feeds the talker nothing (the thinker's tests
    check its stream; the talker ends the request without a frame, see its model.py)."""
    completion = _ask(client, _question())
    message = completion.choices[0].message
    assert message.audio is None and message.content
    assert completion.usage.completion_tokens == MAX_TOKENS


async def test_a_spoken_realtime_turn_is_heard_and_answered_aloud(server: ServerProcess) -> None:
    """The turn's clip reaches the thinker (its prompt grows with it); the answer's text and
    24 kHz audio come from the model; with no transcription model in the repository the
    turn's transcript stays null."""
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    async with client.realtime.connect(model=MODEL) as conn:
        await _until(conn, "session.created")
        await conn.session.update(
            session={
                "type": "realtime",
                "audio": {"input": {"turn_detection": None}},
                "max_output_tokens": MAX_TOKENS,
            }
        )
        t = np.arange(OUT_RATE) / OUT_RATE  # a second at the session's 24 kHz PCM16
        pcm = (0.3 * np.sin(2 * np.pi * 440.0 * t) * 32767).astype("<i2").tobytes()
        await conn.input_audio_buffer.append(audio=base64.b64encode(pcm).decode())
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        events = await _until(conn, "response.done")
        committed = next(e for e in events if e.type == "input_audio_buffer.committed")
        await conn.conversation.item.retrieve(item_id=committed.item_id)
        retrieved = (await _until(conn, "conversation.item.retrieved"))[-1]
    response = events[-1].response
    assert response.status == "completed"
    assert response.usage.input_tokens >= 12  # a second of audio: 13 of the tower's rows
    transcript = "".join(
        e.delta for e in events if e.type == "response.output_audio_transcript.delta"
    )
    audio = b"".join(
        base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta"
    )
    assert transcript and len(audio) / 2 / OUT_RATE == pytest.approx(SPOKEN_S, abs=0.2)
    assert not any("input_audio_transcription" in e.type for e in events)
    assert retrieved.item.content[0].transcript is None


async def _until(conn: Any, last: str) -> list[Any]:
    events: list[Any] = []

    async def collect() -> None:
        async for event in conn:
            events.append(event)
            if event.type == last:
                return

    await asyncio.wait_for(collect(), 300)
    return events
