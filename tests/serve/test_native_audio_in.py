"""A model that hears audio itself (`audio_input = "native"`): chat's `input_audio` parts and
realtime's spoken turns reach its entry as `contracts.AudioPart`s, not transcripts.

A real server (`python -m omni_server`) over a repository of stand-ins in processes of their
own (tests/fixtures/hearing_thinker.py: a thinker that answers with what it was handed, the
samples it decoded from each clip and the parts' order; a transcriber; fake_voice.py: a tone a
character through the real audio encoder), driven with the official `openai` client. The same
thinker serves a cascade model too (`ears-cascade`, the default `audio_input`), whose clips the
stand-in transcriber hears first, as before.
"""

from __future__ import annotations

import asyncio
import base64
import io
import wave
from collections.abc import Iterator

import httpx2 as httpx
import numpy as np
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from omni_server.audio import decode
from omni_server.compiler.compiler import compile_repository
from omni_server.contracts import AudioPart
from omni_server.pipeline import Runtime
from omni_server.serve import create_app
from omni_server.serve.options import ServeOptions
from omni_server.serve.realtime.conversation import (
    MAX_HEARD_BYTES,
    MAX_HEARD_TURNS,
    Conversation,
    Item,
)
from tests.fixtures import FIXTURES
from tests.fixtures.fake_voice import SECONDS_PER_CHARACTER
from tests.helpers.repo import make_repo, toml
from tests.helpers.server import ServerProcess

pytestmark = pytest.mark.timeout(180)

STAGES = {
    "thinker": toml("""
        backend = "model.py:HearingThinker"
        process = "thinker"
        terminal = true
        stream_to = "voice"
        [scheduler]
        kind = "stream"
        """),
    "voice": toml("""
        backend = "model.py:FakeVoice"
        process = "voice"
        terminal = true
        [scheduler]
        kind = "stream"
        """),
    "asr": toml("""
        backend = "model.py:StandInTranscriber"
        process = "thinker"
        terminal = true
        """),
}
MODELS = toml("""
    [models.ears]
    entry = "thinker"
    tasks = ["chat", "realtime"]
    audio_input = "native"
    voices = ["joe"]
    default_voice = "joe"

    [models.ears.voice_aliases]
    alloy = "joe"

    [models.ears-cascade]
    entry = "thinker"
    stages = ["thinker"]
    tasks = ["chat"]

    [models.stand-in-asr]
    entry = "asr"
    tasks = ["transcription"]
    """)
RATE = 16_000
CLIP_SAMPLES = 8_000  # half a second


def _wav(samples: int, rate: int = RATE) -> bytes:
    tone = 0.3 * np.sin(2 * np.pi * 440.0 * np.arange(samples) / rate)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((tone * 32767).astype("<i2").tobytes())
    return out.getvalue()


CLIP = _wav(CLIP_SAMPLES)


def _question(data: bytes = CLIP, fmt: str = "wav") -> list[dict]:
    audio = {"data": base64.b64encode(data).decode(), "format": fmt}
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Please answer:"},
                {"type": "input_audio", "input_audio": audio},
                {"type": "text", "text": "now"},
            ],
        }
    ]


HEARD = f"text=14 audio={CLIP_SAMPLES} text=3"  # what the thinker was handed, in order


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("native-audio")
    files = {
        "thinker": FIXTURES / "hearing_thinker.py",
        "asr": FIXTURES / "hearing_thinker.py",
        "voice": FIXTURES / "fake_voice.py",
    }
    repo = make_repo(root / "repo", STAGES, MODELS, files)
    with ServerProcess.start(repo, root / "server.log") as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> Iterator[OpenAI]:
    with OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


# ---- chat


def test_clips_reach_the_model_as_audio_in_order_and_text_only_has_no_speech(client):
    completion = client.chat.completions.create(model="ears", messages=_question())
    message = completion.choices[0].message
    assert message.content == f"{HEARD} speech=none"  # modalities left out: no voice
    assert message.audio is None


def test_a_whole_answer_with_audio(client):
    completion = client.chat.completions.create(
        model="ears",
        messages=_question(),
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"},
    )
    message = completion.choices[0].message
    assert message.content is None
    assert message.audio.transcript == f"{HEARD} speech=joe"
    clip = decode(base64.b64decode(message.audio.data), "wav")
    assert clip.sample_rate == 24_000
    expected = len(message.audio.transcript) * SECONDS_PER_CHARACTER
    assert clip.samples.size / clip.sample_rate == pytest.approx(expected, abs=0.01)


def test_a_streamed_answer_interleaves_transcript_and_audio_deltas(client):
    stream = client.chat.completions.create(
        model="ears",
        messages=_question(),
        modalities=["text", "audio"],
        audio={"voice": "joe", "format": "pcm16"},
        stream=True,
    )
    chunks = list(stream)
    audios = [c.choices[0].delta.audio for c in chunks if c.choices and c.choices[0].delta.audio]
    assert all(c.choices[0].delta.content is None for c in chunks if c.choices)
    assert audios[0].id.startswith("audio_") and [a.id for a in audios if a.id] == [audios[0].id]
    transcript = "".join(a.transcript or "" for a in audios)
    assert transcript == f"{HEARD} speech=joe"
    data = [base64.b64decode(a.data) for a in audios if a.data]
    assert len(data) > 1  # the voice's chunks, as they came
    assert len(b"".join(data)) / 2 / 24_000 == pytest.approx(
        len(transcript) * SECONDS_PER_CHARACTER, abs=0.01
    )
    assert audios[-1].expires_at is not None
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_streamed_text_answer_hears_the_clip(client):
    stream = client.chat.completions.create(model="ears", messages=_question(), stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == f"{HEARD} speech=none"


@pytest.mark.parametrize(
    ("data", "fmt", "why"),
    [
        (b"this is not a wav file at all" * 10, "wav", "no wav header"),  # the server's look
        (CLIP[:44] + b"\x00" * 10, "wav", "declares 16000 bytes but holds 10"),  # cut
        (CLIP, "mp3", "no mp3 header"),  # a wav sent as mp3
        # a wav header and no audio: the server's look passes it, the stage refuses it
        (b"RIFF\x24\x00\x00\x00WAVEjunk" + bytes(40), "wav", "cannot decode"),
    ],
)
def test_audio_that_is_not_audio_is_a_400_naming_the_part(client, data, fmt, why):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="ears", messages=_question(data, fmt))
    assert err.value.body["param"] == "messages[0].content[1]"
    assert err.value.body["code"] == "invalid_audio"
    assert why in err.value.body["message"]


def test_a_model_that_transcribes_still_hears_through_the_transcription_model(client):
    completion = client.chat.completions.create(model="ears-cascade", messages=_question())
    read = f"Please answer: a stand-in transcript of {len(CLIP)} bytes now"
    assert completion.choices[0].message.content == f"text={len(read)} speech=none"


def test_its_voices_are_listed(server):
    models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    ears = next(m for m in models if m["id"] == "ears")
    assert ears["voices"] == ["joe"] and ears["voice_aliases"] == {"alloy": "joe"}
    assert ears["audio_input"] == "native"
    assert next(m for m in models if m["id"] == "ears-cascade")["audio_input"] == "transcribe"
    # a chat model with voices and no speech task lists them, as a speech model does
    voices = httpx.get(server.url + "/v1/audio/voices", timeout=30).json()["data"]
    assert [(v["model"], v["id"], v["aliases"], v["default"]) for v in voices] == [
        ("ears", "joe", ["alloy"], True)
    ]


# ---- realtime

PCM_RATE = 24_000


async def _until(conn, last: str) -> list:
    events = []

    async def collect():
        async for event in conn:
            events.append(event)
            if event.type == last:
                return

    await asyncio.wait_for(collect(), 60)
    return events


def _spoken(seconds: float) -> str:
    """A tone as base64 PCM16 at 24 kHz (the session's input format)."""
    t = np.arange(int(seconds * PCM_RATE)) / PCM_RATE
    pcm = (0.3 * np.sin(2 * np.pi * 440.0 * t) * 32767).astype("<i2").tobytes()
    return base64.b64encode(pcm).decode()


def _said(text: str) -> dict:
    return {"type": "input_text", "text": text}


def _clips(answer: str) -> list[int]:
    """The samples of each clip the thinker heard, in the conversation's order."""
    return [int(w.removeprefix("audio=")) for w in answer.split() if w.startswith("audio=")]


async def test_a_spoken_turn_reaches_the_model_as_audio(server):
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    async with client.realtime.connect(model="ears") as conn:
        await _until(conn, "session.created")
        await conn.session.update(
            session={"type": "realtime", "audio": {"input": {"turn_detection": None}}}
        )
        answers = []
        for seconds in (0.5, 0.25):  # two turns: the second response hears both clips
            await conn.input_audio_buffer.append(audio=_spoken(seconds))
            await conn.input_audio_buffer.commit()
            await conn.response.create()
            events = await _until(conn, "response.done")
            assert events[-1].response.status == "completed"
            answers.append(
                "".join(
                    e.delta for e in events if e.type == "response.output_audio_transcript.delta"
                )
            )
            assert any(e.type == "response.output_audio.delta" for e in events)
            if not any(e.type.endswith("input_audio_transcription.completed") for e in events):
                events += await _until(
                    conn, "conversation.item.input_audio_transcription.completed"
                )
            heard = next(
                e for e in events if e.type.endswith("input_audio_transcription.completed")
            )
            # the repository's transcription model still writes the item's transcript
            assert heard.transcript.startswith("a stand-in transcript of ")
    first, second = (_clips(a) for a in answers)
    assert answers[0].endswith("speech=joe") and len(first) == 1
    assert 0.9 * RATE / 2 <= first[0] <= RATE / 2  # half a second, resampled to 16 kHz
    # the earlier turn is heard again (its clip kept), then the new one
    assert len(second) == 2 and second[0] == first[0]
    assert 0.9 * RATE / 4 <= second[1] <= RATE / 4


# ---- the conversation's clips (units)


def _turn(conversation: Conversation, n: int, clip: bytes, transcript: str | None = None) -> Item:
    content = [{"type": "input_audio", "transcript": transcript}]
    item = Item(id=f"item_{n}", role="user", content=content, clip=clip)
    conversation.add(item)
    return item


def test_a_conversation_keeps_the_newest_clips_then_reads_transcripts():
    conversation = Conversation(max_item_chars=1000, max_chars=10_000)
    turns = [_turn(conversation, n, bytes([n + 1]) * 10, f"turn {n}") for n in range(10)]
    kept = [t for t in turns if t.clip is not None]
    assert kept == turns[-MAX_HEARD_TURNS:]
    messages = conversation.messages("be brief")
    assert messages[0] == {"role": "system", "content": "be brief"}
    # the two oldest turns are read as their transcripts, the rest heard as clips, in order
    assert [m["content"] for m in messages[1:3]] == ["turn 0", "turn 1"]
    heard = [m["content"] for m in messages[3:]]
    assert all(len(c) == 1 and isinstance(c[0], AudioPart) for c in heard)
    assert [c[0].data for c in heard] == [t.clip for t in kept]
    assert conversation.clip_bytes() == 10 * MAX_HEARD_TURNS


def test_clips_are_bounded_in_bytes_and_a_turn_without_transcript_leaves_the_context():
    conversation = Conversation(max_item_chars=1000, max_chars=10_000)
    big = MAX_HEARD_BYTES // 2 + 1
    first = _turn(conversation, 0, b"a" * 10)  # small, but older than a turn past the bound
    second = _turn(conversation, 1, b"b" * big)
    third = _turn(conversation, 2, b"c" * big)
    assert (first.clip, second.clip) == (None, None) and third.clip is not None
    assert conversation.clip_bytes() == big
    assert conversation.messages("") == [{"role": "user", "content": (AudioPart(third.clip),)}]


async def test_with_transcription_off_a_heard_turn_is_not_transcribed(server):
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    async with client.realtime.connect(model="ears") as conn:
        await _until(conn, "session.created")
        audio_in = {"turn_detection": None, "transcription": None}
        await conn.session.update(session={"type": "realtime", "audio": {"input": audio_in}})
        await conn.input_audio_buffer.append(audio=_spoken(0.5))
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        events = await _until(conn, "response.done")
        committed = next(e for e in events if e.type == "input_audio_buffer.committed")
        await conn.conversation.item.retrieve(item_id=committed.item_id)
        events += await _until(conn, "conversation.item.retrieved")
    assert not any("input_audio_transcription" in e.type for e in events)
    assert events[-1].item.content[0].transcript is None
    answer = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    assert len(_clips(answer)) == 1  # heard all the same


async def test_a_user_item_with_audio_is_heard_in_its_parts_order(server):
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    spoken = {"type": "input_audio", "audio": _spoken(0.5)}
    async with client.realtime.connect(model="ears") as conn:
        await _until(conn, "session.created")
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [_said("Listen:"), spoken]}
        )
        # the client's transcript is kept: nothing transcribes this one
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{**spoken, "transcript": "hi"}]}
        )
        await conn.response.create(response={"output_modalities": ["text"]})
        events = await _until(conn, "response.done")
        if not any(e.type.endswith("input_audio_transcription.completed") for e in events):
            events += await _until(conn, "conversation.item.input_audio_transcription.completed")
    answer = next(e for e in events if e.type == "response.output_text.done").text
    first, second = answer.removesuffix(" speech=none").split(" | ")
    assert first.startswith("text=7 audio=") and second.startswith("audio=")
    assert all(0.9 * RATE / 2 <= n <= RATE / 2 for n in _clips(answer))
    created = [e.item for e in events if e.type == "conversation.item.added"][:2]
    heard = [e for e in events if e.type.endswith("input_audio_transcription.completed")]
    assert len(heard) == 1 and heard[0].item_id == created[0].id and heard[0].content_index == 1
    assert created[1].content[0].transcript == "hi"


@pytest.mark.parametrize(
    ("content", "param", "fragment"),
    [
        ([{"type": "input_audio", "audio": "%%%"}], "item.content[0].audio", "not base64"),
        ([{"type": "input_audio", "audio": _spoken(0.05)}], "item.content[0].audio", "0.1 to"),
        (
            [{"type": "input_audio", "audio": _spoken(0.2)}] * 2,
            "item.content[1]",
            "at most one input_audio",
        ),
    ],
)
async def test_a_bad_audio_item_is_an_error_event_naming_the_part(server, content, param, fragment):
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    async with client.realtime.connect(model="ears") as conn:
        await _until(conn, "session.created")
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": content}
        )
        error = (await _until(conn, "error"))[-1]
    assert error.error.param == param and fragment in error.error.message


# ---- realtime without a transcription model (in-process: an inline runtime, aiohttp's client)


async def test_without_a_transcription_model_a_heard_turn_has_no_transcript(
    tmp_path, aiohttp_client
):
    stages = {k: v for k, v in STAGES.items() if k != "asr"}
    models = MODELS.split("[models.ears-cascade]")[0]
    files = {"thinker": FIXTURES / "hearing_thinker.py", "voice": FIXTURES / "fake_voice.py"}
    runtime = Runtime(compile_repository(make_repo(tmp_path, stages, models, files)), inline=True)
    await runtime.start()
    try:
        client = await aiohttp_client(create_app(runtime, options=ServeOptions()))
        ws = await client.ws_connect("/v1/realtime?model=ears")
        session = {"type": "realtime", "audio": {"input": {"turn_detection": None}}}
        await ws.send_json({"type": "session.update", "session": session})
        await ws.send_json({"type": "input_audio_buffer.append", "audio": _spoken(0.5)})
        await ws.send_json({"type": "input_audio_buffer.commit"})
        # a text answer: the model's own text, no speech asked of its voice
        await ws.send_json({"type": "response.create", "response": {"output_modalities": ["text"]}})
        events = [await ws.receive_json()]
        while events[-1]["type"] != "response.done":
            events.append(await ws.receive_json())
        committed = next(e for e in events if e["type"] == "input_audio_buffer.committed")
        await ws.send_json({"type": "conversation.item.retrieve", "item_id": committed["item_id"]})
        retrieved = await ws.receive_json()
        while retrieved["type"] != "conversation.item.retrieved":  # rate_limits.updated, ...
            retrieved = await ws.receive_json()
        await ws.close()
    finally:
        await runtime.stop()
    assert not any("input_audio_transcription" in e["type"] for e in events)
    assert retrieved["item"]["content"] == [{"type": "input_audio", "transcript": None}]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    (samples,) = _clips(done["text"])
    assert 0.9 * RATE / 2 <= samples <= RATE / 2 and done["text"].endswith("speech=none")
