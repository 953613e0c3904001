"""Every server event of a realtime session validates against the official `openai` client's
strict types: GA events against `openai.types.realtime`, beta events (`OpenAI-Beta:
realtime=v1`) against `openai.types.beta.realtime`. The client itself builds events without
validating them, so a shape it would reject passes through it unnoticed; here each event is
validated by the model class its `type` names.

On the stand-in thinker and voice of test_realtime_admission.py (an inline runtime, the app with
its middlewares, aiohttp's test client for the WebSocket).
"""

from __future__ import annotations

import base64
import json
import typing
from typing import Any

import pytest
from aiohttp import ClientWebSocketResponse
from aiohttp.test_utils import TestClient
from openai import AsyncOpenAI
from openai.types.beta.realtime import RealtimeServerEvent as BetaServerEvent
from openai.types.realtime import RealtimeServerEvent as GAServerEvent
from pydantic import BaseModel

from tests.fixtures.fake_voice import SECONDS_PER_CHARACTER
from tests.serve.test_realtime_admission import LONG, MODEL, _until, app_client, runtime

__all__ = ["app_client", "runtime"]  # the fixtures, shared with the admission tests

pytestmark = pytest.mark.timeout(120)


def _by_type(union: Any) -> dict[str, type[BaseModel]]:
    """The client's server event union (Annotated[Union[...], discriminator]) by `type`."""
    members = typing.get_args(typing.get_args(union)[0])
    return {
        name: cls
        for cls in members
        for name in typing.get_args(cls.model_fields["type"].annotation)
    }


GA_EVENTS, BETA_EVENTS = _by_type(GAServerEvent), _by_type(BetaServerEvent)


def _validated(event: dict[str, Any], *, beta: bool) -> BaseModel:
    """The event as the client's strict type of its `type`; raises if the client would not."""
    events = BETA_EVENTS if beta else GA_EVENTS
    assert event["type"] in events, f"the client has no {event['type']} event"
    if beta and event["type"] in ("session.created", "session.updated"):
        # the beta session's `model` is a closed list of OpenAI's model names: no other
        # server's model can be one, so that one field is left out of the check
        event = {**event, "session": {**event["session"], "model": "gpt-realtime"}}
    return events[event["type"]].model_validate(event)


async def _connect(client: TestClient, *, beta: bool) -> ClientWebSocketResponse:
    headers = {"OpenAI-Beta": "realtime=v1"} if beta else {}
    return await client.ws_connect(f"/v1/realtime?model={MODEL}", headers=headers)


def _modalities(modalities: list[str], *, beta: bool) -> dict[str, Any]:
    session = (
        {"modalities": modalities}
        if beta
        else {"type": "realtime", "output_modalities": modalities}
    )
    return {"type": "session.update", "session": session}


async def _say(ws: ClientWebSocketResponse, text: str) -> None:
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    await ws.send_str(json.dumps({"type": "conversation.item.create", "item": item}))


@pytest.mark.parametrize("beta", [False, True], ids=["ga", "beta"])
@pytest.mark.parametrize("modality", ["audio", "text"])
async def test_every_event_of_a_turn_validates_as_the_clients_type(app_client, beta, modality):
    client = await app_client()
    ws = await _connect(client, beta=beta)
    events = await _until(ws, "session.created")
    await ws.send_str(json.dumps(_modalities([modality], beta=beta)))
    events += await _until(ws, "session.updated")
    await _say(ws, "hello there")
    await ws.send_str(json.dumps({"type": "response.create"}))
    events += await _until(ws, "response.done")
    await ws.close()
    typed = [_validated(e, beta=beta) for e in events]
    parts = [e for e in typed if e.type.startswith("response.content_part.")]
    assert [p.type for p in parts] == ["response.content_part.added", "response.content_part.done"]
    # a content part event's part is "audio" / "text" in both generations; the item's content
    # keeps GA's "output_audio" / "output_text"
    assert all(p.part.type == modality for p in parts)
    done = next(e for e in events if e["type"] == "response.output_item.done")
    assert done["item"]["content"][0]["type"] == (modality if beta else f"output_{modality}")


@pytest.mark.parametrize("beta", [False, True], ids=["ga", "beta"])
async def test_output_audio_buffer_clear_stops_the_answer_and_is_cleared(app_client, beta):
    client = await app_client()
    ws = await _connect(client, beta=beta)
    await _until(ws, "session.created")
    await ws.send_str(json.dumps({"type": "output_audio_buffer.clear", "event_id": "evt_early"}))
    error = await ws.receive_json()  # no response yet: no audio to clear
    assert error["type"] == "error" and error["error"]["code"] == "output_audio_buffer_empty"
    assert error["error"]["event_id"] == "evt_early"

    await _say(ws, LONG)
    await ws.send_str(json.dumps({"type": "response.create"}))
    audio_delta = "response.audio.delta" if beta else "response.output_audio.delta"
    events = await _until(ws, audio_delta)  # the answer is speaking
    response_id = next(e for e in events if e["type"] == "response.created")["response"]["id"]
    await ws.send_str(json.dumps({"type": "output_audio_buffer.clear"}))
    events = await _until(ws, "response.done")
    cleared = [_validated(e, beta=beta) for e in events if e["type"].startswith("output_audio")]
    assert [(c.type, c.response_id) for c in cleared] == [
        ("output_audio_buffer.cleared", response_id)
    ]
    done = _validated(events[-1], beta=beta)
    assert done.response.status == "cancelled"
    # then OpenAI's rate_limits.updated: the model's admission places, this one free again
    limits = _validated(await ws.receive_json(), beta=beta)
    assert limits.type == "rate_limits.updated"
    [requests] = limits.rate_limits
    assert (requests.name, requests.remaining) == ("requests", requests.limit)

    # after response.done the client may still be playing it: clearing names that response
    await ws.send_str(json.dumps({"type": "output_audio_buffer.clear"}))
    after = await ws.receive_json()
    assert after["type"] == "output_audio_buffer.cleared" and after["response_id"] == response_id
    await ws.close()


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.mark.parametrize("beta", [False, True], ids=["ga", "beta"])
async def test_tools_this_server_cannot_call_are_error_events_naming_the_field(app_client, beta):
    client = await app_client()
    ws = await _connect(client, beta=beta)
    await _until(ws, "session.created")
    refused = [
        ("session.update", {"session": {"tools": [WEATHER]}}, "session.tools"),
        ("session.update", {"session": {"tool_choice": "required"}}, "session.tool_choice"),
        ("response.create", {"response": {"tool_choice": "required"}}, "response.tool_choice"),
        ("response.create", {"response": {"tools": [WEATHER]}}, "response.tools"),
    ]
    for i, (kind, fields, param) in enumerate(refused):
        await ws.send_str(json.dumps({"type": kind, "event_id": f"evt_{i}", **fields}))
        error = _validated(await ws.receive_json(), beta=beta)
        assert error.type == "error"
        assert (error.error.code, error.error.param) == ("unsupported_parameter", param)
        assert error.error.event_id == f"evt_{i}"
    # what asks for no call passes; its session.updated is the next event, so none of the
    # refused events started a response
    await ws.send_str(
        json.dumps({"type": "session.update", "session": {"tools": [], "tool_choice": "auto"}})
    )
    updated = await ws.receive_json()
    assert updated["type"] == "session.updated"
    _validated(updated, beta=beta)
    await _say(ws, "hello")
    await ws.send_str(json.dumps({"type": "response.create", "response": {"tool_choice": "none"}}))
    events = await _until(ws, "response.done")
    types = [e["type"] for e in events]
    assert "response.created" in types  # tool_choice "none" answers as usual
    assert events[-1]["response"]["status"] == "completed"
    await ws.close()


@pytest.mark.parametrize(
    ("output_format", "rate", "bytes_per_sample"),
    [({"type": "audio/pcm", "rate": 24000}, 24000, 2), ({"type": "audio/pcmu"}, 8000, 1)],
)
async def test_the_voice_speaks_at_the_sessions_rate(
    app_client, output_format, rate, bytes_per_sample
):
    """Resampled once: the voice is asked for the output format's own rate (24 kHz PCM16,
    8 kHz G.711), not 24 kHz to be resampled again; the audio is as long as the voice spoke
    (the stand-in speaks 20 ms a character of the transcript, the thinker's inputs as JSON)."""
    client = await app_client()
    ws = await _connect(client, beta=False)
    await _until(ws, "session.created")
    update = {"type": "realtime", "audio": {"output": {"format": output_format}}}
    await ws.send_str(json.dumps({"type": "session.update", "session": update}))
    await _until(ws, "session.updated")
    await _say(ws, "INPUTS")
    await ws.send_str(json.dumps({"type": "response.create"}))
    events = await _until(ws, "response.done")
    await ws.close()
    done = next(e for e in events if e["type"] == "response.output_audio_transcript.done")
    assert json.loads(done["transcript"])["speech"]["sample_rate"] == rate
    audio = b"".join(
        base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta"
    )
    spoken = len(done["transcript"]) * SECONDS_PER_CHARACTER
    assert len(audio) / bytes_per_sample / rate == pytest.approx(spoken, abs=0.01)


async def test_the_beta_client_connects_with_a_ws_base_url(app_client):
    """docs/realtime.md's line for the beta client: it turns an http base URL into wss://
    (TLS) whatever its scheme, so a plain server needs `websocket_base_url="ws://..."`."""
    client = await app_client()
    http_base = str(client.make_url("/v1"))
    openai_client = AsyncOpenAI(
        base_url=http_base,
        api_key="unused",
        websocket_base_url=http_base.replace("http://", "ws://", 1),
    )
    async with openai_client.beta.realtime.connect(model=MODEL) as conn:
        created = await conn.recv()
        await conn.session.update(session={"modalities": ["text"]})
        updated = await conn.recv()
    # the beta session shape: the client sent OpenAI-Beta: realtime=v1
    assert created.type == "session.created" and created.session.input_audio_format == "pcm16"
    assert updated.type == "session.updated" and updated.session.modalities == ["text"]
