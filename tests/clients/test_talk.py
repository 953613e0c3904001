"""`omni-client talk`: one spoken turn over the realtime WebSocket, as a user runs it."""

from __future__ import annotations

import io
import wave

import httpx2
import pytest

from omni_bench.wer import word_error_rate
from tests.clients.test_cli import omni_client, one_error_line

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

QUESTION = "What is the capital of France?"


def test_a_spoken_question_gets_a_spoken_answer(server_url, tmp_path):
    speech = httpx2.post(
        f"{server_url}/v1/audio/speech",
        json={
            "model": "tts-1",
            "voice": "alloy",
            "input": QUESTION,
            "response_format": "wav",
            "stream": False,
            "seed": 7,  # the voice's noise fixed: the question is the same audio every run
        },
        timeout=120,
    )
    question, answer = tmp_path / "question.wav", tmp_path / "answer.wav"
    question.write_bytes(speech.content)
    result = omni_client(
        "--url",
        server_url,
        "talk",
        "--file",
        str(question),
        "-o",
        str(answer),
        "--instructions",
        "Answer in one short sentence.",
    )
    assert result.returncode == 0, result.stderr.decode()
    lines = result.stderr.decode().splitlines()
    heard = next(line for line in lines if line.startswith("you: "))[5:]
    assert word_error_rate([QUESTION], [heard]) <= 0.2, heard
    spoken = next(line for line in lines if line.startswith("answer: "))[8:]
    assert spoken.strip()
    with wave.open(io.BytesIO(answer.read_bytes())) as w:
        assert w.getframerate() == 24_000 and w.getnframes() > 12_000  # over half a second


def test_a_file_that_is_no_wav_is_a_usage_error(server_url, tmp_path):
    bogus = tmp_path / "question.wav"
    bogus.write_bytes(b"not audio at all")
    result = omni_client("--url", server_url, "talk", "--file", str(bogus))
    assert result.returncode == 2
    assert "not a PCM WAV file" in one_error_line(result)
