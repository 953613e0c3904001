"""`create_app` in-process, over a real runtime placed inline, through aiohttp's test client.

The stage is a stand-in that speaks silence, fast and deterministic (tests/fixtures/silence.py,
whole_body.py); everything else is real: the compiler, the runtime, the app, HTTP round trips.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.pipeline import Runtime
from omni_server.serve import create_app
from tests.fixtures import FIXTURES
from tests.helpers.repo import make_repo, toml

pytestmark = pytest.mark.timeout(60)


async def started_inline(tmp_path, stage_toml: str, model_py: Path) -> Runtime:
    """A one-stage speech model `quiet` (voice `hush`), compiled and started inline."""
    repo = make_repo(
        tmp_path,
        stages={"speaker": stage_toml},
        repository=toml("""
            [models.quiet]
            entry = "speaker"
            tasks = ["speech"]
            voices = ["hush"]
            default_voice = "hush"
            """),
        models={"speaker": model_py},
    )
    runtime = Runtime(compile_repository(repo), inline=True)
    await runtime.start()
    return runtime


@pytest.fixture
async def runtime(tmp_path):
    stage = toml("""
        backend = "Silence"
        terminal = true
        [scheduler]
        kind = "stream"
        """)
    runtime = await started_inline(tmp_path, stage, FIXTURES / "silence.py")
    yield runtime
    await runtime.stop()


SPEECH = {"model": "quiet", "input": "anything", "voice": "hush", "response_format": "pcm"}


async def test_two_apps_keep_their_own_metrics_and_observers(runtime, aiohttp_client):
    first = await aiohttp_client(create_app(runtime))
    second = await aiohttp_client(create_app(runtime))
    assert len(runtime.stage_observers) == 2

    response = await first.post("/v1/audio/speech", json=SPEECH)
    assert response.status == 200
    assert await response.read() == bytes(1440)

    first_metrics = await (await first.get("/metrics")).text()
    second_metrics = await (await second.get("/metrics")).text()
    line = 'omni_requests_total{endpoint="speech",model="quiet",status="200"} 1.0'
    assert line in first_metrics
    assert "omni_requests_total{" not in second_metrics
    # both apps observe the runtime's stages (the observers are per app)
    assert 'omni_stage_compute_seconds_count{stage="speaker"} 1.0' in first_metrics
    assert 'omni_stage_compute_seconds_count{stage="speaker"} 1.0' in second_metrics

    await first.close()
    assert len(runtime.stage_observers) == 1  # cleanup took the app's observer away


async def test_stopped_runtime_answers_503(runtime, aiohttp_client):
    client = await aiohttp_client(create_app(runtime))
    await runtime.stop()
    response = await client.post("/v1/audio/speech", json=SPEECH)
    assert response.status == 503
    assert (await response.json())["error"]["code"] == "not_ready"
    health = await client.get("/health")
    assert health.status == 503 and (await health.json())["status"] == "not_ready"


@pytest.fixture
async def whole_body_runtime(tmp_path):
    runtime = await started_inline(
        tmp_path, 'backend = "WholeBody"\nterminal = true', FIXTURES / "whole_body.py"
    )
    yield runtime
    await runtime.stop()


@pytest.mark.parametrize("stream_format", [None, "audio"])
async def test_a_non_streaming_terminal_returns_the_body_in_its_result(
    whole_body_runtime, aiohttp_client, stream_format
):
    client = await aiohttp_client(create_app(whole_body_runtime))
    body = dict(SPEECH, **({"stream_format": stream_format} if stream_format else {}))
    response = await client.post("/v1/audio/speech", json=body)
    assert response.status == 200
    assert await response.read() == b"\x01\x00" * 240


async def test_a_terminal_that_produces_no_audio_is_a_server_error(
    whole_body_runtime, aiohttp_client
):
    client = await aiohttp_client(create_app(whole_body_runtime))
    response = await client.post("/v1/audio/speech", json=dict(SPEECH, input="forget the audio"))
    assert response.status == 500
    message = (await response.json())["error"]["message"]
    assert "produced no audio" in message and "sample_rate" in message
