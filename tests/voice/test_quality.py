"""Round-trip quality: the bundled Whisper tiny.en transcribes the voice's audio."""

from __future__ import annotations

import pytest

from omni_bench.wer import normalize_text, word_error_rate
from omni_server.audio import decode

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # slow: Whisper WER

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "Doctor Smith will see you in the afternoon, after lunch.",
    "It was a bright cold day in April, and the clocks were striking thirteen.",
]


def test_normalization_and_wer():
    assert normalize_text("Don't STOP - \u201cbelieving\u201d!") == "do not stop believing"
    assert word_error_rate(["a b c d"], ["a b x d"]) == pytest.approx(0.25)
    assert word_error_rate(["Hello, world."], ["hello world"]) == 0.0


def test_transcribed_speech_has_a_low_word_error_rate(voice, whisper):
    hypotheses = []
    for text in SENTENCES:
        speech = voice.speak(text, response_format="mp3", seed=0)
        samples, rate = decode(speech.body, "mp3")
        hypotheses.append(whisper.transcribe(samples, rate))
    wer = word_error_rate(SENTENCES, hypotheses)
    for ref, hyp in zip(SENTENCES, hypotheses, strict=True):
        print(f"REF {ref}\nHYP {hyp}")
    print(f"corpus WER over {len(SENTENCES)} sentences: {wer:.3f}")
    assert wer < 0.15
