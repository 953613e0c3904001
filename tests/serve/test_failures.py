"""Pipeline failures and start-up, on a one-stage repository whose stage fails on request.

The stage is real (a real process, the real runtime); only its "model" is a stand-in
(tests/fixtures/flaky_speaker.py) that emits silence and raises where the text asks it to,
because the embedded voice cannot be made to fail. Its initialize() waits for a gate file, so the
test can observe the server while stages load.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx2
import openai
import pytest
from openai import OpenAI

from tests.fixtures import FIXTURES
from tests.helpers.metrics import samples, value
from tests.helpers.proc import descendants
from tests.helpers.repo import make_repo
from tests.helpers.server import ServerProcess

pytestmark = pytest.mark.timeout(180)


def flaky_repo(root: Path) -> tuple[Path, Path]:
    """A repository of the stand-in speaker, whose initialize() waits for the gate file (not
    made here); returns the repository and the gate's path."""
    root.mkdir(parents=True, exist_ok=True)
    gate = root / "gate"
    first_chunk = root / "first-chunk"
    os.mkfifo(first_chunk, 0o600)
    repo = make_repo(
        root / "repo",
        stages={
            "speaker": f"""
                backend = "FlakySpeaker"
                terminal = true
                [scheduler]
                kind = "stream"
                [parameters]
                gate = "{gate}"
                first_chunk = "{first_chunk}"
            """
        },
        repository="""
            [models.flaky]
            entry = "speaker"
            tasks = ["speech"]
            voices = ["silence"]
        """,
        models={"speaker": FIXTURES / "flaky_speaker.py"},
    )
    return repo, gate


@pytest.fixture(scope="module")
def flaky(tmp_path_factory):
    root = tmp_path_factory.mktemp("flaky")
    repo, gate = flaky_repo(root)
    server = ServerProcess.start(repo, root / "server.log", wait_ready=False)
    try:
        server.wait_live()
        yield server, gate
    finally:
        server.stop(check=True)


def test_not_ready_while_stages_load_then_ready(flaky):
    server, gate = flaky
    status, body = server.get_json("/health/ready")
    assert status == 503 and body["error"]["type"] == "server_error"
    with (
        OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client,
        pytest.raises(openai.InternalServerError) as caught,
    ):
        client.audio.speech.create(model="flaky", voice="silence", input="hello")
    assert caught.value.status_code == 503
    gate.touch()
    server.wait_ready()
    assert server.get_json("/health")[0] == 200


def tell_the_stage_the_client_has_the_first_chunk(server: ServerProcess) -> None:
    """One byte into the FIFO the stage reads before a "when told" failure."""
    fifo = os.open(server.log_path.parent / "first-chunk", os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fifo, b"!")
    finally:
        os.close(fifo)


@pytest.fixture
def client(flaky):
    server, gate = flaky
    gate.touch()
    server.wait_ready()
    with OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_stage_failure_before_audio_is_500_naming_the_stage(flaky, client: OpenAI):
    server, _ = flaky
    for stream_format in (None, "audio", "sse"):
        # None: the whole response (`"stream": false`); the others stream
        extra = (
            {"extra_body": {"stream": False}}
            if stream_format is None
            else {"stream_format": stream_format}
        )
        with pytest.raises(openai.InternalServerError) as caught:
            client.audio.speech.create(
                model="flaky", voice="silence", input="fail early", response_format="pcm", **extra
            )
        assert caught.value.status_code == 500
        assert caught.value.code == "pipeline_error"
        message = caught.value.body["message"]
        # the stage, not the exception's text (a library's internals): that goes to the log
        assert "speaker" in message and "injected failure" not in message
        request_id = message.rsplit("request ", 1)[1].rstrip(")")
        assert f"speech request {request_id} failed" in server.log()
    assert "injected failure before any audio" in server.log()


def test_whole_response_failing_midway_is_500(flaky, client: OpenAI):
    server, _ = flaky
    with pytest.raises(openai.InternalServerError) as caught:
        client.audio.speech.create(
            model="flaky",
            voice="silence",
            input="fail midway",
            response_format="pcm",
            extra_body={"stream": False},
        )
    assert "speaker" in caught.value.body["message"]
    assert "injected failure after the first chunk" in server.log()


def test_audio_stream_failing_midway_ends_without_its_final_chunk(flaky, client: OpenAI):
    server, _ = flaky
    received = b""
    with client.audio.speech.with_streaming_response.create(
        model="flaky",
        voice="silence",
        input="fail midway when told",
        response_format="pcm",
        stream_format="audio",
    ) as response:
        assert response.status_code == 200
        with pytest.raises(httpx2.RemoteProtocolError):
            for chunk in response.iter_bytes():
                told = len(received) >= 2400
                received += chunk
                if not told and len(received) >= 2400:
                    tell_the_stage_the_client_has_the_first_chunk(server)
    assert received == bytes(2400)  # the first chunk, then a broken stream


def test_sse_stream_failing_midway_never_sends_done(flaky, client: OpenAI):
    server, _ = flaky
    events = []
    with (
        client.audio.speech.with_streaming_response.create(
            model="flaky",
            voice="silence",
            input="fail midway when told",
            response_format="pcm",
            stream_format="sse",
        ) as response,
        pytest.raises(httpx2.RemoteProtocolError),
    ):
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
                if len(events) == 1:
                    tell_the_stage_the_client_has_the_first_chunk(server)
    assert [event["type"] for event in events] == ["speech.audio.delta"]


def test_failures_are_counted(flaky, client: OpenAI):
    server, _ = flaky
    before = samples(server.metrics())
    with pytest.raises(openai.InternalServerError):
        client.audio.speech.create(model="flaky", voice="silence", input="fail early")
    ok = client.audio.speech.create(
        model="flaky", voice="silence", input="fine", response_format="pcm"
    )
    assert ok.content == bytes(4800)
    after = samples(server.metrics())
    labels = {"endpoint": "speech", "model": "flaky"}
    assert (
        value(after, "omni_requests_total", status="500", **labels)
        == value(before, "omni_requests_total", status="500", **labels) + 1
    )
    assert value(after, "omni_request_failures_total", reason="pipeline_error", **labels) > value(
        before, "omni_request_failures_total", reason="pipeline_error", **labels
    )


def test_a_dead_stage_process_is_restarted_and_serves_again(flaky, client: OpenAI):
    """Last in this module. Its one stage process killed: the server says unhealthy (503,
    requests refused as unavailable) until the supervisor's restart is up, then serves again."""
    server, _ = flaky
    [stage_process] = descendants(server.proc.pid)
    os.kill(stage_process, signal.SIGKILL)
    seen: list[tuple[int, str]] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status, body = server.get_json("/health")
        seen.append((status, body["status"]))
        if status == 200 and (503, "unhealthy") in seen:  # down, then back
            break
        time.sleep(0.02)
    assert (503, "unhealthy") in seen, seen[:5]
    assert seen[-1] == (200, "ok"), seen[-5:]
    [successor] = descendants(server.proc.pid)
    assert successor != stage_process
    speech = client.audio.speech.create(
        model="flaky", voice="silence", input="hello", extra_body={"stream": False}
    )
    assert speech.content
    assert server.get_json("/health/live")[0] == 200  # the HTTP server itself was fine throughout


def test_the_restart_is_counted_in_the_metrics(flaky):
    """After the test above: the death and the restart of the flaky stage's process."""
    server, _ = flaky
    text = server.metrics()
    assert 'omni_supervision_events_total{event="death",subject="speaker@r0"} 1.0' in text, text[
        -800:
    ]
    assert 'omni_supervision_events_total{event="restart",subject="speaker@r0"} 1.0' in text


def test_a_stopped_stage_process_is_killed_after_the_heartbeat_timeout_given(tmp_path):
    """`--heartbeat-timeout 2`: a SIGSTOPped stage process is found frozen at 2 s (the default
    says 6), killed, and its successor serves."""
    repo, gate = flaky_repo(tmp_path)
    gate.touch()
    with ServerProcess.start(
        repo, tmp_path / "server.log", "--heartbeat-timeout", "2", wait_ready=True
    ) as server:
        [stage_process] = descendants(server.proc.pid)
        os.kill(stage_process, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while "frozen: no heartbeat" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "frozen: no heartbeat for 2 s" in server.log()
        server.wait_ready()
        [successor] = descendants(server.proc.pid)
        assert successor != stage_process
        with OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            speech = client.audio.speech.create(
                model="flaky", voice="silence", input="hello", extra_body={"stream": False}
            )
        assert speech.content


def test_a_pipeline_slower_than_the_start_timeout_exits_1_naming_it(tmp_path):
    repo, _ = flaky_repo(tmp_path)  # the gate never opens: still loading when the bound passes
    server = ServerProcess.start(
        repo, tmp_path / "server.log", "--start-timeout", "3", wait_ready=False
    )
    try:
        assert server.proc.wait(timeout=60) == 1  # long before the stage's own 60 s wait ends
        log = server.log()
        assert "stages not ready after 3 s" in log and "Traceback" not in log
        assert not descendants(server.proc.pid)
    finally:
        server.stop(check=False)
