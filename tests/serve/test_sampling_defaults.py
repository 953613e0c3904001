"""A model's sampling defaults (its entry stage's `[sampling]`) on the wire: what chat and realtime
requests that leave a field out hand the thinker, what /v1/models shows.

The thinker is the stand-in of tests/fixtures/fake_thinker.py (its "INPUTS" answer is the JSON of
the inputs it received, and `max_tokens` cuts its "You said: ..." answer a word a token) on a
real inline runtime; the app, its routes and the realtime session are the server's own.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.pipeline import Runtime
from omni_server.serve import create_app
from omni_server.serve.options import ServeOptions
from tests.fixtures import FIXTURES
from tests.helpers.repo import make_repo, toml

pytestmark = pytest.mark.timeout(120)

THINKER = toml("""
    backend = "FakeThinker"
    terminal = true
    [scheduler]
    kind = "stream"
""")
TUNED = {"temperature": 0.2, "top_p": 0.9, "min_p": 0.05, "max_tokens": 4}
SAMPLING = toml("""
    [sampling]
    temperature = 0.2
    top_p = 0.9
    min_p = 0.05
    max_tokens = 4
""")
MODELS = toml("""
    [models.tuned]
    entry = "tuned"
    tasks = ["chat"]

    [models.tuned-realtime]
    entry = "tuned"
    tasks = ["realtime"]

    [models.plain]
    entry = "plain"
    tasks = ["chat"]
""")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "max_tokens")


@pytest.fixture
async def runtime(tmp_path: Path) -> AsyncIterator[Runtime]:
    fake = FIXTURES / "fake_thinker.py"
    root = make_repo(
        tmp_path / "repo",
        {"tuned": THINKER + SAMPLING, "plain": THINKER},
        MODELS,
        {"tuned": fake, "plain": fake},
    )
    running = Runtime(compile_repository(root), inline=True)
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


@pytest.fixture
async def http(runtime, aiohttp_client):
    return await aiohttp_client(create_app(runtime, options=ServeOptions()))


async def chat(http, model: str, content: str, **fields: Any) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": content}], **fields}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status == 200, await response.text()
    return await response.json()


def sampling(inputs: dict) -> dict:
    return {k: inputs[k] for k in SAMPLING_FIELDS}


async def test_a_request_without_sampling_fields_gets_the_models_defaults(http):
    answer = await chat(http, "tuned", "INPUTS")
    inputs = json.loads(answer["choices"][0]["message"]["content"])
    assert sampling(inputs) == {**TUNED, "top_k": 0}  # top_k: not declared, OpenAI's (off)
    plain = await chat(http, "plain", "INPUTS")
    inputs = json.loads(plain["choices"][0]["message"]["content"])
    assert sampling(inputs) == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "max_tokens": None,
    }


async def test_a_requests_own_values_win(http):
    asked = {"temperature": 0.0, "top_p": 1.0, "top_k": 7, "min_p": 0.0, "max_tokens": 100}
    answer = await chat(http, "tuned", "INPUTS", **asked)
    assert sampling(json.loads(answer["choices"][0]["message"]["content"])) == asked


async def test_the_default_max_tokens_bounds_an_answer(http):
    cut = await chat(http, "tuned", "one two three four five")
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["choices"][0]["message"]["content"] == "You said: one two"  # 4 tokens
    assert cut["usage"]["completion_tokens"] == 4
    whole = await chat(http, "tuned", "one two three four five", max_completion_tokens=50)
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["choices"][0]["message"]["content"] == "You said: one two three four five"


async def test_models_show_their_defaults_beside_openais_fields(http):
    listed = await (await http.get("/v1/models")).json()
    models = {m["id"]: m for m in listed["data"]}
    assert models["tuned"]["sampling"] == TUNED
    assert models["tuned-realtime"]["sampling"] == TUNED  # the same entry stage
    assert models["plain"]["sampling"] == {}  # nothing declared: OpenAI's defaults
    for model in models.values():
        assert model["object"] == "model" and model["owned_by"] and model["created"] > 0
    one = await (await http.get("/v1/models/tuned")).json()
    assert one["sampling"] == TUNED


async def test_a_realtime_session_starts_with_the_models_defaults(http):
    """The beta session echoes temperature; the response's inputs show what the thinker got."""
    async with http.ws_connect(
        "/v1/realtime?model=tuned-realtime", headers={"OpenAI-Beta": "realtime=v1"}
    ) as ws:
        created = await ws.receive_json()
        assert created["session"]["temperature"] == 0.2
        assert created["session"]["max_response_output_tokens"] == 4
        await ws.send_json({"type": "session.update", "session": {"modalities": ["text"]}})
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "INPUTS"}],
        }
        await ws.send_json({"type": "conversation.item.create", "item": item})
        await ws.send_json({"type": "response.create"})
        deltas = []
        while True:
            event = await asyncio.wait_for(ws.receive_json(), 60)
            if event["type"] == "response.text.delta":
                deltas.append(event["delta"])
            if event["type"] == "response.done":
                break
    assert event["response"]["status"] == "completed", event
    assert sampling(json.loads("".join(deltas))) == {**TUNED, "top_k": 0}
