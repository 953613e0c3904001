"""`create_app` in-process, over a real runtime placed inline, through aiohttp's test client.

The stage is a stand-in that speaks silence (fast and deterministic); everything else is real:
the compiler, the runtime, the app, HTTP round trips.
"""

from __future__ import annotations

import pytest

from omni_server.repository.compiler import compile_repository
from omni_server.runtime import Runtime
from omni_server.serve import create_app
from tests.helpers.repo import make_repo

pytestmark = pytest.mark.timeout(60)

SILENCE = """\
from omni_server.backend import StageBackend


class Silence(StageBackend):
    def generate(self, request):
        for _ in range(3):
            yield {"audio": bytes(480)}
        return {"sample_rate": 24000, "audio_seconds": 0.03, "format": "pcm", "sentences": 3}
"""


@pytest.fixture
async def runtime(tmp_path):
    repo = make_repo(
        tmp_path,
        stages={"speaker": 'backend = "Silence"\nterminal = true\n[scheduler]\nkind = "stream"'},
        repository='[models.quiet]\nentry = "speaker"\ntasks = ["speech"]\nvoices = ["hush"]\n'
        'default_voice = "hush"',
        models={"speaker": SILENCE},
    )
    runtime = Runtime(compile_repository(repo), inline=True)
    await runtime.start()
    yield runtime
    await runtime.stop()


SPEECH = {"model": "quiet", "input": "anything", "response_format": "pcm"}


async def test_two_apps_keep_their_own_metrics_and_observers(runtime, aiohttp_client):
    first = await aiohttp_client(create_app(runtime))
    second = await aiohttp_client(create_app(runtime))
    assert len(runtime.stage_observers) == 2

    response = await first.post("/v1/audio/speech", json=SPEECH)  # no voice: the default one
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
