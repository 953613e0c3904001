"""`omni-client speak-stream`: text piped in, speech out, over the speech input stream."""

from __future__ import annotations

import io
import wave

import httpx2
import pytest

from omni_bench.wer import word_error_rate
from tests.clients.test_cli import omni_client, one_error_line

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TEXT = "The quick brown fox jumps over the lazy dog. Then it runs into the forest."


def _heard(server_url: str, wav: bytes) -> str:
    answer = httpx2.post(
        f"{server_url}/v1/audio/transcriptions",
        data={"model": "whisper-1"},
        files={"file": ("said.wav", wav, "audio/wav")},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()["text"]


def test_piped_text_is_spoken_to_a_wav_file(server_url, tmp_path):
    out = tmp_path / "spoken.wav"
    result = omni_client(
        "--url",
        server_url,
        "speak-stream",
        "--sample-rate",
        "16000",
        "--seed",  # seeded: the voice's noise is no dice roll
        "7",
        "-o",
        str(out),
        stdin=TEXT.encode(),
    )
    assert result.returncode == 0, result.stderr.decode()
    with wave.open(io.BytesIO(out.read_bytes())) as w:
        assert w.getframerate() == 16_000 and w.getnframes() > 16_000  # over a second
    heard = _heard(server_url, out.read_bytes())
    assert word_error_rate([TEXT], [heard]) <= 0.2, heard


def test_raw_pcm_goes_to_stdout(server_url):
    result = omni_client("--url", server_url, "speak-stream", stdin=b"Hello there.")
    assert result.returncode == 0, result.stderr.decode()
    assert len(result.stdout) > 24_000 and len(result.stdout) % 2 == 0  # PCM16, 24 kHz


def test_a_refused_voice_is_a_usage_error_naming_it(server_url):
    result = omni_client("--url", server_url, "speak-stream", "--voice", "nobody", stdin=b"hi")
    assert result.returncode == 2
    line = one_error_line(result)
    assert "unknown voice 'nobody'" in line and "(param: voice)" in line


def test_an_unreachable_server_is_a_server_error(unreachable_url):
    result = omni_client("--url", unreachable_url, "speak-stream", stdin=b"hi")
    assert result.returncode == 1
    assert "cannot stream to" in one_error_line(result)
