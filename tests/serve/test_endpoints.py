"""`/v1/models`, health probes and Prometheus metrics of a real server."""

from __future__ import annotations

import urllib.request

import pytest
from openai import OpenAI

from omni_server.compiler.compiler import compile_repository
from tests.helpers.metrics import samples, value
from tests.helpers.server import EMBEDDED_REPO
from tests.serve.speech_texts import ONE_SENTENCE, THREE_SENTENCES

pytestmark = pytest.mark.timeout(120)


def test_models_list_has_openai_shape(client: OpenAI):
    models = client.models.list()
    assert models.object == "list"
    by_id = {model.id: model for model in models.data}
    assert set(by_id) == set(compile_repository(EMBEDDED_REPO).models)
    joe = by_id["piper-joe"]
    assert joe.object == "model" and joe.owned_by == "omni-server" and joe.created > 0
    extra = joe.model_extra
    assert extra["tasks"] == ["speech"]
    assert "tts-1" in extra["aliases"] and "joe" in extra["voices"]
    assert extra["voice_aliases"]["alloy"] == "joe"


def test_model_retrieved_by_id_or_alias(client: OpenAI):
    assert client.models.retrieve("piper-joe").id == "piper-joe"
    assert client.models.retrieve("tts-1").id == "piper-joe"


def test_health_probes(server):
    assert server.get_json("/health/live") == (200, {"status": "live"})
    assert server.get_json("/health/ready") == (200, {"status": "ready"})
    status, body = server.get_json("/health")
    served = list(compile_repository(EMBEDDED_REPO).models)
    assert status == 200 and body["status"] == "ok" and body["models"] == served


def test_metrics_count_requests_latency_and_stages(server, client: OpenAI):
    before = samples(server.metrics())
    client.audio.speech.create(model="tts-1", voice="alloy", input=ONE_SENTENCE)
    with pytest.raises(Exception):  # noqa: B017  any 400 will do: it is counted
        client.audio.speech.create(model="tts-1", voice="alloy", input="")
    after = samples(server.metrics())

    def grew(name: str, by: float = 1, **labels: str) -> bool:
        return value(after, name, **labels) - value(before, name, **labels) == by

    assert grew("omni_requests_total", endpoint="speech", model="piper-joe", status="200")
    assert grew("omni_requests_total", endpoint="speech", model="piper-joe", status="400")
    assert grew(
        "omni_request_failures_total",
        endpoint="speech",
        model="piper-joe",
        reason="invalid_request",
    )
    assert grew("omni_time_to_first_audio_seconds_count", model="piper-joe")
    assert grew("omni_request_latency_seconds_count", endpoint="speech", model="piper-joe")
    assert value(after, "omni_audio_seconds_total", model="piper-joe") > value(
        before, "omni_audio_seconds_total", model="piper-joe"
    )
    assert value(after, "omni_requests_in_flight", model="piper-joe") == 0
    for stage in compile_repository(EMBEDDED_REPO).models["piper-joe"].stages:
        assert grew("omni_stage_queue_seconds_count", stage=stage)
        assert grew("omni_stage_compute_seconds_count", stage=stage)


def test_metrics_show_each_voice_streams_lead_over_its_listener(server, client: OpenAI):
    """The acoustic stage says how long its chunks play, so each request's smallest lead (the
    audio a listener playing from the first chunk still had when a later one came out) is
    observed once; a lone request on an idle voice stays ahead of real time."""
    before = samples(server.metrics())
    client.audio.speech.create(model="tts-1", voice="alloy", input=THREE_SENTENCES)
    after = samples(server.metrics())
    count = "omni_stage_stream_lead_seconds_count"
    assert value(after, count, stage="acoustic") - value(before, count, stage="acoustic") == 1
    lead = value(after, "omni_stage_stream_lead_seconds_sum", stage="acoustic") - value(
        before, "omni_stage_stream_lead_seconds_sum", stage="acoustic"
    )
    assert lead > 0
    # stages whose chunks are not media observe no lead
    assert value(after, count, stage="text_frontend") == 0


def test_root_serves_the_playground_page_when_installed(server):
    from omni_server.serve.app import STATIC_DIR

    request = urllib.request.Request(server.url + "/")
    if (STATIC_DIR / "index.html").is_file():
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/html")
    else:
        status, body = server.get_json("/")
        assert status == 404 and body["error"]["code"] == "not_found"
