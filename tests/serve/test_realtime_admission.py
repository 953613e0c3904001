"""A realtime response takes the request path every HTTP request takes (serve/pipeline_call.py):
it holds an admission place of its model and shows in the in-pipeline gauge while it runs, and
with no place free it is refused with an `error` event instead of running.

In-process and real: an inline runtime over the stand-in thinker and voice of the chat tests
(tests/fixtures/fake_thinker.py: "SLOW N" answers N words 100 ms apart; fake_voice.py), the app
with its middlewares, aiohttp's test client for HTTP and the realtime WebSocket.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import ClientWebSocketResponse
from aiohttp.test_utils import TestClient

from omni_server.compiler.compiler import compile_repository
from omni_server.pipeline import Runtime
from omni_server.serve import create_app
from omni_server.serve.options import ServeOptions
from tests.fixtures import FIXTURES
from tests.helpers.metrics import samples, value
from tests.helpers.repo import make_repo, toml

pytestmark = pytest.mark.timeout(120)

MODEL = "fake-realtime"
STAGES = {
    "thinker": toml("""
        backend = "model.py:FakeThinker"
        terminal = true
        stream_to = "voice"
        [scheduler]
        kind = "stream"
        """),
    "voice": toml("""
        backend = "model.py:FakeVoice"
        terminal = true
        [scheduler]
        kind = "stream"
        """),
}
# one model both HTTP chat and the realtime session use: they share its admission places
MODELS = f"""
[models.{MODEL}]
entry = "thinker"
tasks = ["chat", "realtime"]
voices = ["joe"]
default_voice = "joe"
"""
LONG = "SLOW 200"  # 20 s of answer unless cancelled: in flight for as long as a test looks


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
    """Every server event up to and including the first of type `kind`."""
    events = []
    while not events or events[-1]["type"] != kind:
        events.append(await ws.receive_json())
    return events


async def _session(client: TestClient) -> ClientWebSocketResponse:
    ws = await client.ws_connect(f"/v1/realtime?model={MODEL}")
    await _until(ws, "session.created")
    return ws


async def _say(ws: ClientWebSocketResponse, text: str) -> None:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    await ws.send_str(json.dumps({"type": "conversation.item.create", "item": item}))
    await _until(ws, "conversation.item.done")


async def _in_pipeline(client: TestClient) -> float:
    metrics = samples(await (await client.get("/metrics")).text())
    return value(metrics, "omni_requests_in_flight", model=MODEL)


def _chat(text: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **fields}


async def test_a_realtime_response_in_flight_holds_its_models_place(app_client):
    client = await app_client(max_in_flight=1, max_queued=0)
    ws = await _session(client)
    await _say(ws, LONG)
    await ws.send_str(json.dumps({"type": "response.create"}))
    await _until(ws, "response.output_audio_transcript.delta")  # the answer is streaming

    refused = await client.post("/v1/chat/completions", json=_chat("hello"))
    assert refused.status == 429
    assert (await refused.json())["error"]["code"] == "rate_limit_exceeded"

    await ws.send_str(json.dumps({"type": "response.cancel"}))
    done = (await _until(ws, "response.done"))[-1]["response"]
    assert done["status"] == "cancelled"
    # response.done comes after the place was given back: the next request gets it
    served = await client.post("/v1/chat/completions", json=_chat("hello"))
    assert served.status == 200, await served.text()
    assert (await served.json())["choices"][0]["message"]["content"] == "You said: hello"
    await ws.close()


async def test_a_response_with_no_free_place_is_an_error_event_and_never_runs(app_client):
    client = await app_client(max_in_flight=1, max_queued=0)
    ws = await _session(client)
    await _say(ws, "hello")
    # an HTTP chat streaming its answer holds the model's one place
    holder = await client.post("/v1/chat/completions", json=_chat(LONG, stream=True))
    assert holder.status == 200
    await holder.content.readline()  # its first chunk: it is in the pipeline

    await ws.send_str(json.dumps({"type": "response.create", "event_id": "evt_answer"}))
    error = await ws.receive_json()
    assert error["type"] == "error"
    assert error["error"]["code"] == "rate_limit_exceeded"
    assert error["error"]["type"] == "requests"  # HTTP's 429 words
    assert error["error"]["event_id"] == "evt_answer"
    assert f"model '{MODEL}'" in error["error"]["message"]
    # no response ran: the next event answers the next client event, and a new response.create
    # is not refused as "already has an active response"
    await ws.send_str(json.dumps({"type": "session.update", "session": {"instructions": "Hi"}}))
    assert (await ws.receive_json())["type"] == "session.updated"
    assert await _in_pipeline(client) == 1  # the HTTP request only

    holder.close()  # the client leaves: its request is aborted and its place freed
    while await _in_pipeline(client) != 0:  # its handler ends on the server's own time
        await asyncio.sleep(0.05)
    await ws.send_str(json.dumps({"type": "response.create"}))
    events = await _until(ws, "response.done")
    assert events[0]["type"] == "response.created"
    assert events[-1]["response"]["status"] == "completed"
    await ws.close()


async def test_the_in_pipeline_gauge_counts_a_realtime_response_while_it_runs(app_client):
    client = await app_client()
    ws = await _session(client)
    assert await _in_pipeline(client) == 0
    await _say(ws, LONG)
    await ws.send_str(json.dumps({"type": "response.create"}))
    await _until(ws, "response.output_audio.delta")
    assert await _in_pipeline(client) == 1

    await ws.send_str(json.dumps({"type": "response.cancel"}))
    await _until(ws, "response.done")
    assert await _in_pipeline(client) == 0
    await ws.close()
