"""The bounds of a realtime session (issue 27: items 1, 8, 10; docs/realtime.md#bounds).

In-process and real: an inline runtime over the stand-in thinker and voice of the chat tests
(tests/fixtures/fake_thinker.py: "OVERFLOW" is refused as over its context), the app with its
middlewares, aiohttp's test client for HTTP and the WebSocket, and the official `openai` client
for the refused connect. The real thinker's side of item 1 (a prompt that takes seconds to
tokenize) is in tests/thinker/test_thinker_bounds.py.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import threading
import weakref
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from aiohttp import ClientWebSocketResponse, WSServerHandshakeError
from aiohttp.test_utils import TestClient
from openai import AsyncOpenAI
from websockets.exceptions import InvalidStatus

from omni_server.compiler.compiler import compile_repository
from omni_server.pipeline import Runtime
from omni_server.serve import create_app
from omni_server.serve.options import ServeOptions
from omni_server.serve.realtime.input_audio import MAX_BUFFER_S, VAD_RATE, InputAudio
from omni_server.serve.realtime.protocol import MAX_EVENT_BYTES
from omni_server.serve.state import STATE
from tests.fixtures import FIXTURES
from tests.helpers.raw_websocket import masked_text_frame, send_then_read_close
from tests.helpers.repo import make_repo
from tests.serve.test_realtime_admission import MODEL, MODELS, STAGES

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
async def runtime(tmp_path) -> AsyncIterator[Runtime]:
    files = {"thinker": FIXTURES / "fake_thinker.py", "voice": FIXTURES / "fake_voice.py"}
    repo = make_repo(tmp_path / "repo", STAGES, MODELS, files)
    runtime = Runtime(compile_repository(repo), inline=True)
    await runtime.start()
    try:
        yield runtime
    finally:
        await runtime.stop()


@pytest.fixture
def app_client(runtime, aiohttp_client):
    async def make(**options: Any) -> TestClient:
        return await aiohttp_client(create_app(runtime, options=ServeOptions(**options)))

    return make


async def _until(ws: ClientWebSocketResponse, kind: str) -> list[dict[str, Any]]:
    events = []
    while not events or events[-1]["type"] != kind:
        events.append(await ws.receive_json())
    return events


async def _session(client: TestClient) -> ClientWebSocketResponse:
    ws = await client.ws_connect(f"/v1/realtime?model={MODEL}", max_msg_size=0)
    await _until(ws, "session.created")
    return ws


def _item(text: str, event_id: str = "evt_item") -> str:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    return json.dumps({"type": "conversation.item.create", "event_id": event_id, "item": item})


async def _wait_closed(client: TestClient) -> None:
    """Until the server has let go of every session (its handler's `finally` ran)."""
    sessions = client.server.app[STATE].realtime_sessions
    while len(sessions):
        await asyncio.sleep(0.01)


# ---- item 1: items and the conversation, in characters and tokens --------------------------


async def test_an_item_of_15_mb_is_an_error_event_and_the_session_goes_on(app_client):
    client = await app_client()
    ws = await _session(client)
    await ws.send_str(_item("x" * 15_000_000, "evt_huge"))  # the probe's input
    error = (await _until(ws, "error"))[-1]["error"]
    assert error["code"] == "item_too_large"
    assert error["event_id"] == "evt_huge"
    assert error["type"] == "invalid_request_error" and error["param"] == "item.content"
    assert "--max-realtime-item-chars" in error["message"]
    # nothing was added: the answer reads only the next item
    await ws.send_str(_item("hello"))
    await _until(ws, "conversation.item.done")
    await ws.send_str(json.dumps({"type": "response.create"}))
    done = (await _until(ws, "response.done"))[-1]["response"]
    assert done["status"] == "completed"
    assert done["output"][0]["content"][0]["transcript"] == "You said: hello"
    await ws.close()


async def test_a_lone_surrogate_is_an_error_event_and_the_session_goes_on(app_client):
    """Issue 42 item 1: the probe's item (`"Hello \\ud800 there. "`) and the same in the
    instructions are refused with the event, as HTTP refuses them (400 `invalid_value`), and
    never reach the thinker; the session answers the next item."""
    client = await app_client()
    ws = await _session(client)
    await ws.send_str(_item("Hello \ud800 there. ", "evt_surrogate"))
    error = (await _until(ws, "error"))[-1]["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_value")
    assert error["param"] == "item.content[0].text"
    assert "unpaired UTF-16 surrogate (U+D800)" in error["message"]
    update = {"type": "session.update", "session": {"instructions": "Be \udc00 brief."}}
    await ws.send_str(json.dumps(update))
    error = (await _until(ws, "error"))[-1]["error"]
    assert error["param"] == "session.instructions" and "U+DC00" in error["message"]
    await ws.send_str(_item("hello"))
    await _until(ws, "conversation.item.done")
    await ws.send_str(json.dumps({"type": "response.create"}))
    done = (await _until(ws, "response.done"))[-1]["response"]
    assert done["status"] == "completed"
    assert done["output"][0]["content"][0]["transcript"] == "You said: hello"
    await ws.close()


async def test_an_event_over_16_mib_closes_with_1009_and_its_reason(app_client):
    """Issue 42 item 5 on realtime's socket: an event past its bound closes with 1009 and a
    reason naming it, read by a client that sends the whole frame first (no reset: 1006)."""
    client = await app_client()
    event = json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (17 << 20)})
    frame = masked_text_frame(event.encode())
    path = f"/v1/realtime?model={MODEL}"
    code, reason = await asyncio.to_thread(send_then_read_close, client.server.port, path, frame)
    assert code == 1009
    assert reason == f"message too big: at most {MAX_EVENT_BYTES} bytes".encode()


async def test_the_whole_conversation_is_bounded_in_characters(app_client):
    client = await app_client(max_realtime_item_chars=1000, max_realtime_conversation_chars=2500)
    ws = await _session(client)
    for i in range(2):
        await ws.send_str(_item("y" * 1000, f"evt_{i}"))
        await _until(ws, "conversation.item.done")
    await ws.send_str(_item("z" * 600, "evt_over"))  # 2600 > 2500
    error = (await _until(ws, "error"))[-1]["error"]
    assert error["code"] == "conversation_too_large" and error["event_id"] == "evt_over"
    assert "--max-realtime-conversation-chars" in error["message"]
    await ws.close()


async def test_a_conversation_over_the_thinkers_context_is_an_error_event(app_client):
    """The token bound is the thinker's context: its refusal is the client's error, in the
    realtime error event's shape, and the response fails (nothing was answered)."""
    client = await app_client()
    ws = await _session(client)
    await ws.send_str(_item("OVERFLOW"))
    await _until(ws, "conversation.item.done")
    await ws.send_str(json.dumps({"type": "response.create"}))
    events = await _until(ws, "response.done")
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert len(errors) == 1
    assert errors[0]["type"] == "invalid_request_error"
    assert errors[0]["code"] == "context_length_exceeded" and errors[0]["param"] == "messages"
    assert events[-1]["response"]["status"] == "failed"
    await ws.close()


# ---- item 8: a session's bytes, the number of sessions, memory given back ------------------


async def test_a_session_holds_a_bounded_number_of_bytes(app_client):
    """30 items of 15 MB (the probe) and 5 minutes of appended audio: the session keeps
    within its bounds (conversation characters, 120 s of uncommitted audio)."""
    options = {"max_realtime_item_chars": 1000, "max_realtime_conversation_chars": 4000}
    client = await app_client(**options)
    ws = await _session(client)
    session = next(iter(client.server.app[STATE].realtime_sessions))
    await ws.send_str(json.dumps({"type": "session.update", "session": {"turn_detection": None}}))
    await _until(ws, "session.updated")
    for i in range(30):
        await ws.send_str(_item("x" * 15_000_000, f"evt_{i}"))
        assert (await _until(ws, "error"))[-1]["error"]["code"] == "item_too_large"
    for i in range(4):
        await ws.send_str(_item("y" * 1000, f"evt_ok_{i}"))
        await _until(ws, "conversation.item.done")
    second = np.zeros(24_000, "<i2").tobytes()  # 1 s of PCM16 at 24 kHz
    for _ in range(5):
        audio = base64.b64encode(second * 60).decode()  # a minute an event
        await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
    await ws.send_str(_item("!", "evt_marker"))  # events run in order: the appends are in
    assert (await _until(ws, "error"))[-1]["error"]["event_id"] == "evt_marker"  # full now
    audio_bound = MAX_BUFFER_S * VAD_RATE * 4  # float32 samples
    assert session.conversation.chars() == 4000
    assert session.held_bytes() <= 4 * 4000 + audio_bound
    assert session.held_bytes() > audio_bound * 0.9  # the audio really was held
    await ws.close()


async def test_sessions_over_the_bound_are_refused_before_the_upgrade(app_client):
    client = await app_client(max_realtime_sessions=2)
    first, second = await _session(client), await _session(client)
    with pytest.raises(WSServerHandshakeError) as refused:
        await client.ws_connect(f"/v1/realtime?model={MODEL}")
    assert refused.value.status == 429
    assert refused.value.headers["Retry-After"] == "1"
    # the official client: the upgrade's 429 and OpenAI's error JSON reach the caller
    url = str(client.make_url("/v1"))
    async with AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as openai_client:
        with pytest.raises(InvalidStatus) as err:
            async with openai_client.realtime.connect(model=MODEL):
                pass
        response = err.value.response
        assert response.status_code == 429
        body = json.loads(response.body)
        assert body["error"]["code"] == "rate_limit_exceeded"
        assert "--max-realtime-sessions" in body["error"]["message"]
        await first.close()
        await _wait_for_sessions(client, 1)
        async with openai_client.realtime.connect(model=MODEL) as conn:  # a place is free
            assert (await conn.recv()).type == "session.created"
    await second.close()


async def _wait_for_sessions(client: TestClient, count: int) -> None:
    sessions = client.server.app[STATE].realtime_sessions
    while len(sessions) > count:
        await asyncio.sleep(0.01)


async def test_a_closed_session_leaves_nothing_behind(app_client):
    """Memory is given back on close: the session, its conversation and its audio buffer are
    unreachable once the socket is gone (weak references die; no RSS reading)."""
    client = await app_client()
    ws = await _session(client)
    await ws.send_str(_item("hello " * 5000))
    await _until(ws, "conversation.item.done")
    audio = base64.b64encode(np.zeros(24_000 * 30, "<i2").tobytes()).decode()
    await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
    await ws.send_str(json.dumps({"type": "response.create"}))
    await _until(ws, "response.done")
    session = next(iter(client.server.app[STATE].realtime_sessions))
    refs = [weakref.ref(x) for x in (session, session.conversation, session.conversation.items[0])]
    refs.append(weakref.ref(session.input_audio))
    del session
    await ws.close()
    await _wait_closed(client)
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


# ---- item 10: a big append does not block the event loop -----------------------------------


async def test_a_big_append_is_decoded_off_the_event_loop(app_client, monkeypatch):
    """While an 11.5 MiB append (the probe's) is decoded, /health/live is answered. The decode
    is held until the health answer came: on the event loop it could never come (the test
    and the server share one loop), and the decode would give up waiting."""
    entered, answered = threading.Event(), threading.Event()
    waited: list[bool] = []
    append = InputAudio.append

    def held_append(self: InputAudio, raw: object) -> Any:
        entered.set()
        waited.append(answered.wait(timeout=30))
        return append(self, raw)

    monkeypatch.setattr(InputAudio, "append", held_append)
    client = await app_client()
    ws = await _session(client)
    pcm = np.zeros(int(11.5 * 2**20) // 2, "<i2").tobytes()  # 11.5 MiB of PCM16 silence
    await ws.send_str(
        json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()})
    )
    while not entered.is_set():  # the server is in the append (on the loop: it blocks here)
        await asyncio.sleep(0.01)
    live = await client.get("/health/live")
    assert live.status == 200
    answered.set()
    await ws.send_str(json.dumps({"type": "input_audio_buffer.commit"}))
    events = await _until(ws, "input_audio_buffer.committed")
    assert not [e for e in events if e["type"] == "error"]
    assert waited == [True]  # the decode ran after /health/live was answered
    await ws.close()
