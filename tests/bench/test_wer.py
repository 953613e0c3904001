"""WER normalization and scoring, and one real round trip: the voice in-process -> Whisper."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from omni_bench.wer import Transcriber, normalize_text, score

REPOSITORY = Path(__file__).resolve().parents[2] / "repository"


@pytest.mark.parametrize(
    ("spoken_as_written", "as_transcribed"),
    [
        ("The meeting starts at 10:30 a.m. sharp.", "The meeting starts at 10.30 AM sharp."),
        ("Dr. Smith paid $3.50 for 42 apples.", "Doctor Smith paid $3.50 for forty-two apples."),
        ("Isn't it on Jan. 5th?", "Is not it on Jan 5?"),
        ("The colour of the harbour", "the color of the harbor"),
        ("Room 214, please!", "room two hundred fourteen please"),
        ("It\u2019s forty-two.", "it's 42"),
    ],
)
def test_normalization_makes_equivalent_spellings_equal(spoken_as_written, as_transcribed):
    assert normalize_text(spoken_as_written) == normalize_text(as_transcribed)


def test_normalization_keeps_real_differences():
    assert normalize_text("the red boat") != normalize_text("the bread boat")
    assert normalize_text("42 apples") != normalize_text("24 apples")


def test_score_counts_edits_over_reference_words():
    refs = ["the cat sat on the mat", "hello world"]
    hyps = ["the cat sat on a mat", ""]  # 1 substitution; 2 deletions (a silent clip)
    report = score(refs, hyps)
    assert report.clips == 2
    assert report.corpus_wer == pytest.approx(3 / 8)
    assert report.mean_clip_wer == pytest.approx((1 / 6 + 1.0) / 2)
    assert report.clips_above_half == 1
    assert report.worst[0]["reference"] == "hello world"


def test_score_rejects_mismatched_lengths_and_empty_references():
    with pytest.raises(ValueError, match="2 references but 1"):
        score(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="no reference"):
        score(["...", "!"], ["x", "y"])


@pytest.mark.timeout(120)
@pytest.mark.slow  # the real voice, then Whisper
def test_round_trip_of_the_real_voice_is_intelligible():
    from omni_bench.peers import InProcessTarget

    texts = [
        "The kettle clicked off just as the rain began to tap against the window.",
        "Please leave the blue folder on the desk by the door.",
    ]

    async def synthesize():
        voice = InProcessTarget(REPOSITORY, max_workers=1, response_format="wav", stream=False)
        await voice.start()
        try:
            return [(await voice.synthesize(t))[1] for t in texts]
        finally:
            await voice.close()

    clips = asyncio.run(synthesize())
    transcriber = Transcriber(cpu_threads=2)
    hyps = [transcriber.transcribe(c) for c in clips]
    report = score(texts, hyps)
    assert report.corpus_wer < 0.2, hyps
    # Whisper hears words, not noise: scrambled references must score far worse.
    assert score(texts[::-1], hyps).corpus_wer > 0.6
