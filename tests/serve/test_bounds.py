"""Work per request (after NFKC), input with nothing to say, admission, and what a stage's
failure may tell a client; in-process over the stand-in voice (tests/serve/inline.py)."""

from __future__ import annotations

import asyncio

import pytest

from omni_server.serve.admission import Admission, RateLimited
from omni_server.serve.state import STATE
from tests.fixtures.serve_stand_in import LIBRARY_DETAIL
from tests.serve.inline import SPEECH

pytestmark = pytest.mark.timeout(60)
JSON = {"Content-Type": "application/json"}


async def error_of(response) -> dict:
    return (await response.json())["error"]


async def test_characters_are_counted_after_nfkc(app_client):
    client = await app_client()
    # U+FDFA is one character as sent and 18 after NFKC: 300 of them are 5400 characters
    response = await client.post("/v1/audio/speech", json=dict(SPEECH, input="\ufdfa" * 300))
    assert response.status == 400
    error = await error_of(response)
    assert error["param"] == "input" and error["code"] == "string_above_max_length"
    assert "5400 characters after Unicode NFKC normalization (300 as sent)" in error["message"]
    # the same, within the bound, is served (the pipeline gets the normalized text)
    assert (await client.post("/v1/audio/speech", json=dict(SPEECH, input="\ufdfa" * 10))).ok


async def test_estimated_audio_seconds_are_bounded(app_client):
    client = await app_client(max_audio_seconds=60)
    text = "word " * 40  # 200 characters: 50 s at speed 1, estimated high
    assert (await client.post("/v1/audio/speech", json=dict(SPEECH, input=text))).status == 200
    slow = await client.post("/v1/audio/speech", json=dict(SPEECH, input=text, speed=0.5))
    assert slow.status == 400
    error = await error_of(slow)
    assert error["code"] == "audio_above_max_length" and error["param"] == "input"
    assert "at most 60 s" in error["message"] and "at most 120 characters" in error["message"]


@pytest.mark.parametrize("text", ["\u200b", ".....", " \u200b\u2060 ...!? "])
@pytest.mark.parametrize("response_format", ["mp3", "opus", "aac", "pcm"])
async def test_nothing_to_say_is_400_never_an_empty_file(app_client, text, response_format):
    client = await app_client()
    response = await client.post(
        "/v1/audio/speech", json=dict(SPEECH, input=text, response_format=response_format)
    )
    assert response.status == 400
    error = await error_of(response)
    assert error["param"] == "input" and "nothing to speak" in error["message"]


@pytest.mark.parametrize("stream", [True, False])
async def test_a_pipeline_that_makes_no_audio_is_400_not_an_empty_200(app_client, stream):
    client = await app_client()
    response = await client.post(
        "/v1/audio/speech", json=dict(SPEECH, input="mute hello", stream=stream)
    )
    assert response.status == 400
    assert "found nothing to speak" in (await error_of(response))["message"]


async def test_lone_surrogate_is_400(app_client):
    client = await app_client()
    body = b'{"model": "quiet", "voice": "hush", "input": "\\ud800 hello"}'
    response = await client.post("/v1/audio/speech", data=body, headers=JSON)
    assert response.status == 400
    error = await error_of(response)
    assert error["param"] == "input" and "surrogate (U+D800)" in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "quiet\\udc00", "voice": "hush", "input": "hi"}', "model"),
        (b'{"model": "quiet", "voice": {"id": "\\ud800"}, "input": "hi"}', "voice.id"),
        (b'{"model": "quiet", "voice": "hush", "input": "hi", "\\ud800": 1}', None),
    ],
    ids=["model", "nested", "key"],
)
async def test_a_lone_surrogate_anywhere_in_a_body_is_400_naming_its_place(app_client, body, param):
    """Issue 42 item 1: every string of a JSON body is checked as it is parsed (one check for
    every edge), so no field, nested value or key carries a surrogate past the door."""
    client = await app_client()
    response = await client.post("/v1/audio/speech", data=body, headers=JSON)
    assert response.status == 400
    error = await error_of(response)
    assert (error["code"], error["param"]) == ("invalid_value", param)
    assert "unpaired UTF-16 surrogate" in error["message"]


async def test_deeply_nested_json_is_400_invalid_json(app_client):
    client = await app_client()
    for depth in (1000, 100_000):
        body = b"[" * depth + b"]" * depth
        response = await client.post("/v1/audio/speech", data=body, headers=JSON)
        assert response.status == 400
        error = await error_of(response)
        assert error["code"] == "invalid_json" and "nested too deeply" in error["message"]


async def test_stage_failure_names_the_stage_not_the_library_text(app_client):
    client = await app_client()
    for stream in (True, False):
        response = await client.post(
            "/v1/audio/speech", json=dict(SPEECH, input="fail now", stream=stream)
        )
        assert response.status == 500
        error = await error_of(response)
        assert error["code"] == "pipeline_error" and "'speaker'" in error["message"]
        assert "libfoo" not in error["message"] and "/opt/secret" not in error["message"]
        assert LIBRARY_DETAIL.split(":")[0] not in await response.text()


async def test_beyond_the_places_and_the_queue_requests_get_429(app_client):
    client = await app_client(max_in_flight=1, max_queued=0)
    slow = await client.post("/v1/audio/speech", json=dict(SPEECH, input="slow 30"))
    assert slow.status == 200  # streaming: headers sent, the request holds its place
    refused = await client.post("/v1/audio/speech", json=SPEECH)
    assert refused.status == 429
    assert refused.headers["Retry-After"] == "1"
    error = await error_of(refused)
    assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded"
    assert "'quiet' is at capacity" in error["message"]
    slow.close()  # the client leaves: its place frees
    for _ in range(100):
        response = await client.post("/v1/audio/speech", json=SPEECH)
        if response.status == 200:
            break
        await asyncio.sleep(0.05)
    assert response.status == 200
    metrics = await (await client.get("/metrics")).text()
    assert 'reason="rate_limited"' in metrics


async def until_metrics_show(client, sample: str) -> None:
    """Until /metrics has `sample` (a state reached on the server's own time, however loaded)."""
    for _ in range(400):
        if sample in await (await client.get("/metrics")).text():
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"/metrics never showed {sample}")


async def test_a_queued_request_waits_for_a_place_then_runs(app_client):
    client = await app_client(max_in_flight=1, max_queued=1, queue_timeout_s=30)
    first = asyncio.ensure_future(
        client.post("/v1/audio/speech", json=dict(SPEECH, input="slow 20", stream=False))
    )
    await until_metrics_show(client, 'omni_requests_in_flight{model="quiet"} 1.0')
    second = asyncio.ensure_future(client.post("/v1/audio/speech", json=SPEECH))
    # queued behind the first, which holds the one place for 2 s
    await until_metrics_show(client, 'omni_requests_queued{model="quiet"} 1.0')
    assert (await first).status == 200
    answered = await second
    assert answered.status == 200 and await answered.read() == bytes(1440)
    metrics = await (await client.get("/metrics")).text()
    assert 'omni_requests_queued{model="quiet"} 0.0' in metrics


async def test_admission_is_first_come_and_times_out():
    admission = Admission(max_in_flight=1, max_queued=2, queue_timeout_s=0.2)
    order: list[str] = []

    async def take(name: str, hold: float) -> None:
        async with admission.place("m"):
            order.append(name)
            await asyncio.sleep(hold)

    first = asyncio.ensure_future(take("a", 0.05))
    await asyncio.sleep(0)
    rest = [asyncio.ensure_future(take(n, 0.0)) for n in ("b", "c")]
    await asyncio.gather(first, *rest)
    assert order == ["a", "b", "c"]
    assert admission.in_flight("m") == 0 and admission.queued("m") == 0

    holder = asyncio.ensure_future(take("d", 1.0))
    await asyncio.sleep(0)
    with pytest.raises(RateLimited):
        await take("e", 0)  # waited 0.2 s in the queue, no place came
    cancelled = asyncio.ensure_future(take("f", 0))
    await asyncio.sleep(0.01)
    cancelled.cancel()  # a waiter that leaves takes no place with it
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert admission.queued("m") == 0
    await holder
    assert admission.in_flight("m") == 0


async def test_a_stopping_server_says_not_ready_and_refuses_new_requests(app_client):
    client = await app_client()
    slow = await client.post("/v1/audio/speech", json=dict(SPEECH, input="slow 3"))
    lifecycle = client.app[STATE].lifecycle
    draining = asyncio.ensure_future(lifecycle.drain(grace_s=30))
    await asyncio.sleep(0.05)
    assert (await client.get("/health/ready")).status == 503
    health = await client.get("/health")
    assert health.status == 503 and (await health.json())["status"] == "stopping"
    refused = await client.post("/v1/audio/speech", json=SPEECH)
    assert refused.status == 503 and (await error_of(refused))["code"] == "not_ready"
    assert (await client.get("/health/live")).status == 200
    assert await slow.read() == bytes(480) * 3  # the request in flight finishes in the grace
    assert await draining == 0  # nothing had to be cancelled
