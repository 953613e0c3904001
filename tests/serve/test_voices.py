"""`/v1/audio/voices`: the served models' voices listed, custom voices added, used and deleted.

In-process and real: an inline runtime over a test repository whose voice stage clones
(tests/fixtures/cloning_voice.py, a STAND-IN for the Higgs pipeline: it "speaks" its reference
clip, so the clip's tone in the answer shows the clip reached the stage), behind the stand-in
thinker for chat and realtime, plus a model that cannot clone (serve_stand_in.py) and a
STAND-IN transcription model that hears a clip's tone (for OpenAI's form, which carries no
transcript); the app
with its middlewares, a real data directory, aiohttp's test client for HTTP and the WebSocket.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import stat
import time
import wave
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import FormData
from aiohttp.test_utils import TestClient
from openai import AsyncOpenAI, NotFoundError

from omni_server.audio import AudioEncoder, decode
from omni_server.compiler.compiler import compile_repository
from omni_server.contracts import SpeechOptions, speech_payload
from omni_server.pipeline import PipelineError, Runtime
from omni_server.serve import create_app
from omni_server.serve.options import ServeOptions
from omni_server.serve.pipeline_call import request_error, submitted
from omni_server.serve.state import STATE
from omni_server.serve.voice_store import DataDirError, VoiceStore
from tests.fixtures import FIXTURES
from tests.fixtures.cloning_voice import PLAIN_HZ
from tests.helpers.repo import make_repo, toml

pytestmark = pytest.mark.timeout(120)

CLIP_HZ = 660.0
STAGES = {
    "thinker": toml("""
        backend = "model.py:FakeThinker"
        terminal = true
        stream_to = "voice"
        [scheduler]
        kind = "stream"
        """),
    "voice": toml("""
        backend = "model.py:CloningVoice"
        terminal = true
        voice_cloning = true
        [scheduler]
        kind = "stream"
        """),
    "speaker": toml("""
        backend = "StandIn"
        terminal = true
        [scheduler]
        kind = "stream"
        """),
    "ears": toml("""
        backend = "model.py:ToneEars"
        terminal = true
        [scheduler]
        kind = "stream"
        """),
}
MODELS = """
[models.clone-tts]
entry = "voice"
tasks = ["speech"]
voices = ["plain"]
default_voice = "plain"
language = "en-US"
[models.clone-tts.voice_aliases]
alloy = "plain"

[models.clone-omni]
entry = "thinker"
tasks = ["chat", "realtime"]
voices = ["plain"]
default_voice = "plain"

[models.quiet]
entry = "speaker"
tasks = ["speech"]
voices = ["hush"]

[models.ears]
entry = "ears"
tasks = ["transcription"]
"""
FILES = {
    "thinker": FIXTURES / "fake_thinker.py",
    "voice": FIXTURES / "cloning_voice.py",
    "speaker": FIXTURES / "serve_stand_in.py",
    "ears": FIXTURES / "cloning_voice.py",
}


@pytest.fixture
async def runtime(tmp_path) -> AsyncIterator[Runtime]:
    runtime = Runtime(
        compile_repository(make_repo(tmp_path / "repo", STAGES, MODELS, FILES)), inline=True
    )
    await runtime.start()
    try:
        yield runtime
    finally:
        await runtime.stop()


@pytest.fixture
def data_dir(tmp_path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def app_client(runtime, aiohttp_client, data_dir):
    async def make(**options: Any) -> TestClient:
        options.setdefault("data_dir", data_dir)
        return await aiohttp_client(create_app(runtime, options=ServeOptions(**options)))

    return make


def wav_clip(
    seconds: float = 2.0, rate: int = 24000, hz: float = CLIP_HZ, level: float = 0.4
) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    pcm = (level * np.sin(2 * np.pi * hz * t) * 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return out.getvalue()


def voice_form(model: str = "clone-tts", file: bytes | None = None, **fields: str) -> FormData:
    form = FormData()
    values = {"model": model, "name": "Ada", "transcript": "Hello, this is Ada speaking.", **fields}
    for key, value in values.items():
        form.add_field(key, value)
    form.add_field("file", wav_clip() if file is None else file, filename="clip.wav")
    return form


def dominant_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.argmax(spectrum) * rate / len(samples))


async def _add(client: TestClient, **kwargs: Any) -> dict[str, Any]:
    response = await client.post("/v1/audio/voices", data=voice_form(**kwargs))
    assert response.status == 200, await response.text()
    return await response.json()


async def _speak(client: TestClient, voice: Any, model: str = "clone-tts") -> Any:
    body = {
        "model": model,
        "input": "hello there my friend",
        "voice": voice,
        "response_format": "pcm",
    }
    return await client.post("/v1/audio/speech", json=body)


async def test_lists_every_speaking_models_voices(app_client):
    client = await app_client()
    listing = await (await client.get("/v1/audio/voices")).json()
    assert listing["object"] == "list"
    assert {(v["model"], v["id"]) for v in listing["data"]} == {
        ("clone-tts", "plain"),
        ("clone-omni", "plain"),
        ("quiet", "hush"),
    }
    plain = next(v for v in listing["data"] if v["model"] == "clone-tts")
    assert plain == {
        "id": "plain",
        "object": "voice",
        "model": "clone-tts",
        "name": "plain",
        "language": "en-US",
        "aliases": ["alloy"],
        "default": True,
        "custom": False,
    }
    one = await (await client.get("/v1/audio/voices?model=quiet")).json()
    assert [(v["id"], v["default"], v["language"]) for v in one["data"]] == [("hush", False, None)]
    by_alias = await client.get("/v1/audio/voices?model=alloy")
    assert by_alias.status == 404  # a voice alias is no model
    error = (await by_alias.json())["error"]
    assert error["code"] == "model_not_found" and set(error) == {"message", "type", "param", "code"}


async def test_a_model_that_cannot_clone_refuses_a_new_voice(app_client):
    client = await app_client()
    response = await client.post("/v1/audio/voices", data=voice_form(model="quiet"))
    assert response.status == 400
    error = (await response.json())["error"]
    assert (error["code"], error["param"]) == ("voice_cloning_unsupported", "model")
    assert "clone-tts" in error["message"] and "clone-omni" in error["message"]


async def test_a_custom_voice_is_stored_privately_and_speaks_at_once(app_client, data_dir):
    client = await app_client()
    voice = await _add(client, language="en-GB")
    assert voice["id"].startswith("voice_")
    assert (voice["object"], voice["model"], voice["name"], voice["custom"]) == (
        "audio.voice",
        "clone-tts",
        "Ada",
        True,
    )
    assert voice["type"] == "audio_sample" and abs(voice["created_at"] - time.time()) < 600
    assert voice["language"] == "en-GB"
    folder = data_dir / "voices"
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    files = sorted(p.name for p in folder.iterdir())
    assert files == [f"{voice['id']}.json", f"{voice['id']}.wav"]
    assert all(stat.S_IMODE((folder / f).stat().st_mode) == 0o600 for f in files)

    # listed under every model through the cloning stage, not under the one that cannot clone
    listing = await (await client.get("/v1/audio/voices")).json()
    assert {v["model"] for v in listing["data"] if v["id"] == voice["id"]} == {
        "clone-tts",
        "clone-omni",
    }

    for named in (voice["id"], {"id": voice["id"]}):
        response = await _speak(client, named)
        assert response.status == 200, await response.text()
        samples, rate = decode(await response.read(), "pcm")
        assert abs(dominant_hz(samples, rate) - CLIP_HZ) < 5  # the clip's tone: it arrived
    plain = await _speak(client, "alloy")
    samples, rate = decode(await plain.read(), "pcm")
    assert abs(dominant_hz(samples, rate) - PLAIN_HZ) < 5


async def test_a_custom_voice_speaks_in_chat_audio_and_realtime(app_client):
    client = await app_client()
    voice = (await _add(client))["id"]
    chat = await client.post(
        "/v1/chat/completions",
        json={
            "model": "clone-omni",
            "messages": [{"role": "user", "content": "hello there my good friend"}],
            "modalities": ["text", "audio"],
            "audio": {"voice": voice, "format": "wav"},
        },
    )
    assert chat.status == 200, await chat.text()
    audio = (await chat.json())["choices"][0]["message"]["audio"]["data"]
    samples, rate = decode(base64.b64decode(audio))
    assert abs(dominant_hz(samples, rate) - CLIP_HZ) < 5

    ws = await client.ws_connect("/v1/realtime?model=clone-omni")
    assert (await ws.receive_json())["type"] == "session.created"
    update = {"type": "realtime", "audio": {"output": {"voice": voice}}}
    await ws.send_str(json.dumps({"type": "session.update", "session": update}))
    updated = await ws.receive_json()
    assert updated["type"] == "session.updated", updated
    assert updated["session"]["audio"]["output"]["voice"] == voice
    item = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "hello friend"}],
    }
    await ws.send_str(json.dumps({"type": "conversation.item.create", "item": item}))
    await ws.send_str(json.dumps({"type": "response.create"}))
    pcm = b""
    while True:
        event = await ws.receive_json()
        if event["type"] == "response.output_audio.delta":
            pcm += base64.b64decode(event["delta"])
        if event["type"] == "response.done":
            assert event["response"]["status"] == "completed", event
            break
    await ws.close()
    samples, rate = decode(pcm, "pcm")
    assert abs(dominant_hz(samples, rate) - CLIP_HZ) < 5


async def test_custom_voices_survive_a_restart_and_delete_removes_them(app_client, data_dir):
    first = await app_client()
    voice = (await _add(first))["id"]
    second = await app_client()  # a new app on the same data directory: the server restarted
    listing = await (await second.get("/v1/audio/voices?model=clone-tts")).json()
    assert [v["id"] for v in listing["data"]] == ["plain", voice]
    assert (await _speak(second, voice)).status == 200

    deleted = await second.delete(f"/v1/audio/voices/{voice}")
    assert deleted.status == 200
    assert await deleted.json() == {"id": voice, "object": "audio.voice.deleted", "deleted": True}
    assert list((data_dir / "voices").iterdir()) == []
    gone = await _speak(second, voice)
    assert gone.status == 400
    assert (await gone.json())["error"]["param"] == "voice"
    again = await second.delete(f"/v1/audio/voices/{voice}")
    assert again.status == 404 and (await again.json())["error"]["code"] == "voice_not_found"
    declared = await second.delete("/v1/audio/voices/plain")
    assert declared.status == 404
    assert "declared by the repository" in (await declared.json())["error"]["message"]


async def test_a_request_running_in_a_voice_deleted_meanwhile_finishes(app_client, data_dir):
    """Issue 42 item 5: DELETE while a request in the voice runs. The running request keeps
    the clip (it finishes, in the clip's tone); the voice is gone at once for everything else
    (a later request is a 400 `voice_not_found`, never a 500); the clip goes when the request
    ends."""
    client = await app_client()
    voice = (await _add(client))["id"]
    store = client.app[STATE].voices.store
    clip = data_dir / "voices" / f"{voice}.wav"
    body = {
        "model": "clone-omni",
        "messages": [{"role": "user", "content": "SLOW 20 words to say"}],  # 2 s of words
        "modalities": ["text", "audio"],
        "audio": {"voice": voice, "format": "wav"},
    }
    running = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    while store.holds(voice) == 0:  # admitted: its request holds the clip
        assert not running.done(), await (await running).text()
        await asyncio.sleep(0.01)
    deleted = await client.delete(f"/v1/audio/voices/{voice}")
    assert deleted.status == 200
    assert clip.exists()  # held by the running request
    listing = await (await client.get("/v1/audio/voices?model=clone-tts")).json()
    assert voice not in [v["id"] for v in listing["data"]]
    later = await _speak(client, voice)
    assert later.status == 400
    assert (await later.json())["error"]["param"] == "voice"

    answer = await running
    assert answer.status == 200, await answer.text()
    audio = (await answer.json())["choices"][0]["message"]["audio"]["data"]
    samples, rate = decode(base64.b64decode(audio))
    assert abs(dominant_hz(samples, rate) - CLIP_HZ) < 5  # spoken from the kept clip
    assert store.holds(voice) == 0 and not clip.exists()  # gone with the last request
    assert list((data_dir / "voices").iterdir()) == []


async def test_a_request_naming_a_gone_voice_is_a_400_at_admission(app_client, data_dir):
    """The voice is deleted between the request's voice check and its submit (the window the
    probe hit): the submit finds it gone and answers 400 `voice_not_found`, nothing runs."""
    client = await app_client()
    voice = (await _add(client))["id"]
    state = client.app[STATE]
    model = state.plan.models["clone-tts"]
    choice = state.voices.resolve(model, voice)  # what the endpoint checked
    assert choice is not None and choice.reference is not None
    assert state.voices.store.delete(voice)
    inputs = speech_payload("hello", SpeechOptions(choice.name, reference=choice.reference))
    with pytest.raises(PipelineError) as gone:
        async with submitted(state, model, inputs):
            pass
    assert gone.value.code == "invalid_request"
    assert (gone.value.error_code, gone.value.param) == ("voice_not_found", "voice")
    error = request_error(gone.value)
    assert (error.status, error.code) == (400, "voice_not_found")


async def test_a_realtime_session_whose_voice_is_deleted_fails_its_next_response(app_client):
    client = await app_client()
    voice = (await _add(client))["id"]
    ws = await client.ws_connect("/v1/realtime?model=clone-omni")
    assert (await ws.receive_json())["type"] == "session.created"
    update = {"type": "realtime", "audio": {"output": {"voice": voice}}}
    await ws.send_str(json.dumps({"type": "session.update", "session": update}))
    assert (await ws.receive_json())["type"] == "session.updated"
    assert (await client.delete(f"/v1/audio/voices/{voice}")).status == 200
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
    await ws.send_str(json.dumps({"type": "conversation.item.create", "item": item}))
    await ws.send_str(json.dumps({"type": "response.create"}))
    errors = []
    while True:
        event = await ws.receive_json()
        if event["type"] == "error":
            errors.append(event["error"])
        if event["type"] == "response.done":
            break
    assert event["response"]["status"] == "failed"
    assert [(e["type"], e["code"]) for e in errors] == [
        ("invalid_request_error", "voice_not_found")
    ]
    assert errors[0]["param"] == "session.audio.output.voice"
    await ws.close()


@pytest.mark.parametrize(
    ("clip", "code"),
    [
        (b"not audio at all" * 100, "invalid_audio"),
        (wav_clip(seconds=0.5), "audio_too_short"),
        (wav_clip(seconds=31), "audio_too_long"),
        (wav_clip(rate=8000), "unsupported_sample_rate"),
        (wav_clip(level=0.0), "invalid_audio"),
    ],
    ids=["not-audio", "short", "long", "8khz", "silent"],
)
async def test_a_bad_clip_is_refused_naming_file(app_client, data_dir, clip, code):
    client = await app_client()
    response = await client.post("/v1/audio/voices", data=voice_form(file=clip))
    assert response.status == 400
    error = (await response.json())["error"]
    assert (error["param"], error["code"]) == ("file", code), error
    assert list((data_dir / "voices").iterdir()) == []


def ogg_clip(seconds: float = 3.0, rate: int = 48000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    encoder = AudioEncoder("opus", rate, streaming=False)
    try:
        tone = (0.4 * np.sin(2 * np.pi * CLIP_HZ * t)).astype(np.float32)
        return encoder.encode(tone) + encoder.finish()
    finally:
        encoder.close()


@pytest.mark.parametrize("cut", ["page", "mid-page"])
async def test_a_truncated_clip_is_refused_as_transcription_refuses_it(app_client, cut):
    """Issue 42 item 5: an Ogg clip cut short (at a page boundary: every page whole, the last
    without end-of-stream; or inside a page) still decodes up to the cut; the upload checks it
    whole with transcription's check (audio.containers.cut_short): 400 naming the part."""
    whole = ogg_clip()
    pages = [i for i in range(len(whole)) if whole.startswith(b"OggS", i)]
    truncated = whole[: pages[-2]] if cut == "page" else whole[: pages[-2] + 40]
    client = await app_client()
    response = await client.post("/v1/audio/voices", data=voice_form(file=truncated))
    assert response.status == 400
    error = (await response.json())["error"]
    assert (error["param"], error["code"]) == ("file", "invalid_audio"), error
    assert "truncated" in error["message"]
    accepted = await client.post("/v1/audio/voices", data=voice_form(file=whole))
    assert accepted.status == 200, await accepted.text()  # the same clip whole is a voice


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"transcript": "   "}, "transcript", "invalid_value"),
        ({"transcript": "x" * 2001}, "transcript", "string_above_max_length"),
        ({"name": "n" * 65}, "name", "string_above_max_length"),
        ({"language": "not a tag!"}, "language", "invalid_value"),
        ({"type": "prompt"}, "type", "unsupported_value"),
        ({"frobnicate": "1"}, None, None),  # as OpenAI: "Unrecognized request argument supplied"
    ],
    ids=[
        "blank-transcript",
        "long-transcript",
        "long-name",
        "bad-language",
        "prompt",
        "unknown-field",
    ],
)
async def test_bad_fields_are_refused_by_name(app_client, fields, param, code):
    client = await app_client()
    response = await client.post("/v1/audio/voices", data=voice_form(**fields))
    assert response.status == 400
    error = (await response.json())["error"]
    assert (error["param"], error["code"]) == (param, code)
    assert (param or "frobnicate") in error["message"]


async def test_openais_client_creates_and_deletes_a_voice(app_client):
    """OpenAI's form (audio_sample, consent, name; no model, no transcript) through the official
    client with strict response validation: the one cloning stage takes it, the transcription
    model hears what the clip says, and the answers parse as OpenAI's objects."""
    client = await app_client()
    openai = AsyncOpenAI(
        base_url=str(client.make_url("/v1")),
        api_key="unused",
        max_retries=0,
        _strict_response_validation=True,
    )
    async with openai:
        voice = await openai.audio.voices.create(
            audio_sample=("ada.wav", wav_clip(seconds=1.2)), consent="cons_1234", name="Ada"
        )
        assert (voice.object, voice.name, voice.type) == ("audio.voice", "Ada", "audio_sample")
        stored = client.app[STATE].voices.store.get(voice.id)
        assert (stored.model, stored.consent) == ("clone-tts", "cons_1234")
        assert stored.transcript == f"a tone of {CLIP_HZ:.0f} hertz"  # heard from this clip
        response = await _speak(client, voice.id)
        samples, rate = decode(await response.read(), "pcm")
        assert abs(dominant_hz(samples, rate) - CLIP_HZ) < 5

        deleted = await openai.audio.voices.delete(voice.id)
        assert (deleted.id, deleted.object, deleted.deleted) == (
            voice.id,
            "audio.voice.deleted",
            True,
        )
        with pytest.raises(NotFoundError):
            await openai.audio.voices.delete(voice.id)

        # this server's own parts ride in extra_body (docs/voices.md's complete example)
        named = await openai.audio.voices.create(
            audio_sample=("ada.wav", wav_clip()),
            consent="cons_1234",
            name="Ada",
            extra_body={"model": "clone-omni", "transcript": "Hello, this is Ada."},
        )
        stored = client.app[STATE].voices.store.get(named.id)
        assert (stored.model, stored.transcript) == ("clone-omni", "Hello, this is Ada.")


async def test_a_clip_part_is_named_as_sent(app_client):
    client = await app_client()
    form = FormData()
    form.add_field("name", "Ada")
    form.add_field("audio_sample", wav_clip(seconds=0.5), filename="ada.wav")
    short = await client.post("/v1/audio/voices", data=form)
    assert short.status == 400
    error = (await short.json())["error"]
    assert (error["param"], error["code"]) == ("audio_sample", "audio_too_short")
    only_name = FormData({"name": "Ada"}, default_to_multipart=True)
    missing = await client.post("/v1/audio/voices", data=only_name)
    assert missing.status == 400
    error = (await missing.json())["error"]
    assert (error["param"], error["code"]) == ("audio_sample", "missing_required_parameter")


async def test_bounds_on_clip_bytes_and_stored_voices(app_client):
    client = await app_client(max_custom_voices=1)
    huge = await client.post("/v1/audio/voices", data=voice_form(file=bytes(11 * 1024 * 1024)))
    assert huge.status == 413
    await _add(client)
    full = await client.post("/v1/audio/voices", data=voice_form())
    assert full.status == 400
    assert (await full.json())["error"]["code"] == "voice_limit_reached"


async def test_without_a_data_directory_post_is_refused(app_client):
    client = await app_client(data_dir=None)
    response = await client.post("/v1/audio/voices", data=voice_form())
    assert response.status == 400
    assert (await response.json())["error"]["code"] == "voice_storage_unavailable"


def test_a_data_directory_others_may_enter_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(DataDirError, match="chmod 700"):
        VoiceStore(shared)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "private", target_is_directory=True)
    (tmp_path / "private").mkdir(mode=0o700)
    with pytest.raises(DataDirError, match="link"):
        VoiceStore(link)


def test_a_planted_link_is_not_loaded_as_a_voice(tmp_path):
    store = VoiceStore(tmp_path / "data")
    voice = store.add(
        name="a",
        scope="voice",
        model="m",
        language=None,
        transcript="hi",
        samples=np.zeros(24000, np.float32) + 0.1,
        sample_rate=24000,
        limit=4,
    )
    planted = store.voices_dir / "voice_0000000000000000.json"
    planted.symlink_to(store.voices_dir / f"{voice.id}.json")
    reloaded = VoiceStore(tmp_path / "data")
    assert [v.id for v in reloaded.in_scope("voice")] == [voice.id]
