"""The word-timing examples of docs/serving.md, docs/stream_input.md and docs/realtime.md run
as shown, against the real server on the embedded repository (their 127.0.0.1:8000 made the
test server's address), and print what the docs say they print."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def example(doc: str, section: str) -> str:
    """The first python block after `section`'s heading in docs/`doc`."""
    text = (DOCS / doc).read_text()
    after = text.split(section, 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def run(code: str, server) -> str:
    address = urlparse(server.url).netloc
    result = subprocess.run(
        [sys.executable, "-c", code.replace("127.0.0.1:8000", address)],
        capture_output=True,
        text=True,
        timeout=500,
        env={**os.environ},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_speech_example_prints_words_from_both_forms(server):
    out = run(example("serving.md", "### Word timings (extension)"), server).splitlines()
    assert out[0] == "True Hello there, my friend."
    assert [line.split()[-1] for line in out[1:5]] == ["Hello", "there", "my", "friend"]
    assert [line.split()[-1] for line in out[5:]] == ["Hello", "there", "my", "friend"]


def test_the_stream_input_example_prints_the_spoken_characters(server):
    out = run(example("stream_input.md", "## Word timings"), server).splitlines()
    assert out[-1].split() == ["Hello", "there.", "See", "you", "soon."]
    times = [float(line.split()[0]) for line in out[:-1]]
    assert times == sorted(times) and len(times) >= len("Hello there. See you soon.")


def test_the_realtime_example_cuts_the_transcript_at_the_word_playing(server):
    out = run(example("realtime.md", "## Word timings"), server).splitlines()
    word = out[0].removeprefix("interrupted at: ")
    remembered = out[1].removeprefix("remembered: ")
    assert remembered.rstrip(".,;:!?").endswith(word), out
