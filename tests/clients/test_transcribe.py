"""`transcribe` / `stream_transcription` of both clients and `omni-client transcribe`.

Most tests run against the fake endpoint of transcription_server.py (a stand-in that records
what the client sends and answers a fixed transcript); the last one makes a real round trip
(the server's own voice, then its Whisper) and skips while the server serves no transcription
model.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_client import APIError, AsyncOmniClient, OmniClient, OmniError
from tests.clients.transcription_server import SRT, TRANSCRIPT, VTT, FakeTranscriptionServer

pytestmark = pytest.mark.timeout(120)

AUDIO = b"RIFF....WAVEfmt not really audio: the fake server never decodes it"


@pytest.fixture
def fake() -> Iterator[FakeTranscriptionServer]:
    with FakeTranscriptionServer() as server:
        yield server


@pytest.fixture
def audio_file(tmp_path: Path) -> Path:
    path = tmp_path / "question.wav"
    path.write_bytes(AUDIO)
    return path


def test_the_form_is_openais_and_carries_the_key(fake, audio_file: Path) -> None:
    with OmniClient(fake.url, api_key="sk-test") as client:
        verbose = client.transcribe(
            audio_file,
            language="en",
            prompt="A greeting.",
            temperature=0.2,
            response_format="verbose_json",
            timestamp_granularities=["segment", "word"],
        )
    [upload] = fake.uploads
    assert upload.fields == {
        "model": ["whisper-1"],
        "response_format": ["verbose_json"],
        "language": ["en"],
        "prompt": ["A greeting."],
        "temperature": ["0.2"],
        "timestamp_granularities[]": ["segment", "word"],
        "stream": ["false"],
    }
    assert (upload.filename, upload.file) == ("question.wav", AUDIO)
    assert upload.headers["Authorization"] == "Bearer sk-test"
    assert upload.headers["Content-Type"].startswith("multipart/form-data; boundary=")
    assert isinstance(verbose, dict)
    assert verbose["text"] == TRANSCRIPT and len(verbose["segments"]) == 2 and verbose["words"]


@pytest.mark.parametrize(
    ("response_format", "expected"),
    [("json", {"text": TRANSCRIPT}), ("text", TRANSCRIPT + "\n"), ("srt", SRT), ("vtt", VTT)],
)
def test_each_format_comes_back_as_the_server_wrote_it(
    fake, response_format: str, expected: object
) -> None:
    with OmniClient(fake.url) as client:
        # bytes and a file object are files too; unset options are not sent
        assert client.transcribe(AUDIO, response_format=response_format) == expected
    assert fake.uploads[0].fields == {
        "model": ["whisper-1"],
        "response_format": [response_format],
        "stream": ["false"],
    }
    assert fake.uploads[0].filename == "audio"


def test_stream_yields_deltas_then_done(fake, audio_file: Path) -> None:
    with OmniClient(fake.url) as client, audio_file.open("rb") as f:
        events = list(client.stream_transcription(f))
    *deltas, done = events
    assert [e["type"] for e in deltas] == ["transcript.text.delta"] * len(TRANSCRIPT.split(" "))
    assert "".join(e["delta"] for e in deltas).strip() == TRANSCRIPT
    assert done == {"type": "transcript.text.done", "text": TRANSCRIPT}
    assert fake.uploads[0].fields["stream"] == ["true"]
    assert fake.uploads[0].filename == "question.wav"


def test_a_stream_cut_before_done_is_an_error(fake) -> None:
    with OmniClient(fake.url) as client:
        received = []
        with pytest.raises(OmniError, match=r"before the answer was complete|without transcript"):
            for event in client.stream_transcription(AUDIO, prompt="cut"):
                received.append(event)
    assert [e["type"] for e in received] == ["transcript.text.delta"]


def test_server_errors_carry_the_openai_error(fake) -> None:
    with OmniClient(fake.url) as client, pytest.raises(APIError) as caught:
        client.transcribe(AUDIO, model="no-such-model")
    assert (caught.value.status, caught.value.param, caught.value.code) == (
        404,
        "model",
        "model_not_found",
    )


async def test_async_client_is_the_same(fake, audio_file: Path) -> None:
    async with AsyncOmniClient(fake.url, api_key="sk-async") as client:
        whole = await client.transcribe(audio_file, response_format="text")
        events = [e async for e in client.stream_transcription(audio_file)]
        with pytest.raises(APIError):
            await client.transcribe(AUDIO, model="no-such-model")
        with pytest.raises(OmniError):
            async for _ in client.stream_transcription(AUDIO, prompt="cut"):
                pass
    assert whole == TRANSCRIPT + "\n"
    assert events[-1]["text"] == TRANSCRIPT
    assert [u.fields["stream"] for u in fake.uploads[:2]] == [["false"], ["true"]]
    assert {u.headers["Authorization"] for u in fake.uploads} == {"Bearer sk-async"}


def omni_client(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omni_client", *args],
        input=None if stdin is None else stdin.decode("latin-1"),
        capture_output=True,
        text=True,
        encoding="latin-1",
        timeout=60,
    )


def test_cli_prints_text_json_and_subtitles(fake, audio_file: Path, tmp_path: Path) -> None:
    url = ["--url", fake.url]
    text = omni_client("transcribe", str(audio_file), *url)
    assert (text.returncode, text.stdout) == (0, TRANSCRIPT + "\n"), text.stderr
    verbose = omni_client(
        "transcribe", str(audio_file), "--format", "verbose_json", "--timestamps", "word", *url
    )
    assert json.loads(verbose.stdout)["words"][0]["word"] == "Hello"
    out = tmp_path / "talk.srt"
    srt = omni_client("transcribe", "-", "--format", "srt", "-o", str(out), *url, stdin=AUDIO)
    assert srt.returncode == 0 and srt.stdout == "" and out.read_text() == SRT
    assert fake.uploads[-1].file == AUDIO and fake.uploads[-1].filename == "stdin"
    assert fake.uploads[1].fields["timestamp_granularities[]"] == ["word"]


def test_cli_stream_prints_as_it_comes_and_fails_on_a_cut(fake, audio_file: Path) -> None:
    streamed = omni_client("transcribe", "--stream", str(audio_file), "--url", fake.url)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.strip() == TRANSCRIPT
    cut = omni_client(
        "transcribe", "--stream", str(audio_file), "--prompt", "cut", "--url", fake.url
    )
    assert cut.returncode == 1
    [line] = cut.stderr.strip().splitlines()
    assert line.startswith("omni-client: error: ") and "Traceback" not in cut.stderr
    refused = omni_client("transcribe", "--stream", "--format", "srt", str(audio_file))
    assert refused.returncode == 2 and "--stream" in refused.stderr


def test_cli_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    result = omni_client("transcribe", str(tmp_path / "nope.wav"))
    assert result.returncode == 2
    assert "nope.wav" in result.stderr and "Traceback" not in result.stderr


# -- the real server -----------------------------------------------------------------------------


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_real_round_trip_the_voice_then_whisper(server_url: str) -> None:
    with OmniClient(server_url, timeout=120) as client:
        transcribers = [m["id"] for m in client.models() if "transcription" in m.get("tasks", [])]
        if not transcribers:
            pytest.skip("the server lists no transcription model in /v1/models")
        said = "The quick brown fox jumps over the lazy dog."
        wav = client.speech(said, format="wav", seed=3)
        whole = client.transcribe(wav, model=transcribers[0], filename="fox.wav")
        events = list(client.stream_transcription(wav, model=transcribers[0]))
    assert isinstance(whole, dict)
    assert words(whole["text"]) == words(said), whole
    assert events[-1]["type"] == "transcript.text.done"
    assert events[-1]["text"] == whole["text"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "transcript.text.delta")
    assert words(deltas) == words(whole["text"])
