"""The server process: a taken port, and SIGTERM while a stream is in flight."""

from __future__ import annotations

import subprocess
import sys
import threading
import urllib.request

import pytest

from tests.helpers.server import EMBEDDED_REPO, ROOT, VOICE_ONLY, ServerProcess
from tests.serve.speech_texts import MANY_SENTENCES

pytestmark = pytest.mark.timeout(180)


def test_taken_port_exits_1_with_one_line(server):
    port = str(server.port)
    done = subprocess.run(
        [sys.executable, "-m", "omni_server", "--repo", str(EMBEDDED_REPO), "--port", port],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow  # a server of its own (the real voice only: the stream is speech)
def test_sigterm_during_a_stream_stops_cleanly(tmp_path):
    server = ServerProcess.start(EMBEDDED_REPO, tmp_path / "server.log", *VOICE_ONLY)
    first_chunk = threading.Event()
    outcome: list[str] = []

    def listen() -> None:
        body = (
            '{"model": "tts-1", "voice": "alloy", "response_format": "pcm", '
            f'"stream_format": "audio", "input": "{MANY_SENTENCES}"}}'
        ).encode()
        request = urllib.request.Request(
            server.url + "/v1/audio/speech",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                response.read(1)
                first_chunk.set()
                response.read()
            outcome.append("complete")
        except Exception as exc:  # noqa: BLE001  a cut stream is an acceptable outcome here
            outcome.append(f"cut: {type(exc).__name__}")
        finally:
            first_chunk.set()

    listener = threading.Thread(target=listen)
    listener.start()
    try:
        assert first_chunk.wait(60)
        server.terminate()
    finally:
        server.stop(check=True)  # exit code 0, no stage process and no segment left
        listener.join(60)
    assert outcome, "the client never finished"
    assert "omni-server stopped" in server.log()
