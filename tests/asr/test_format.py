"""The transcript in OpenAI's response formats (pure functions: no server)."""

from __future__ import annotations

import json

from omni_server.serve import transcription_format as fmt

TRANSCRIPT = {
    "text": "Hello there. General Kenobi.",
    "language": "en",
    "duration": 3661.2,
    "segments": [
        {
            "id": 0,
            "start": 0.0,
            "end": 1.25,
            "text": "Hello there.",
            "tokens": [1, 2],
            "avg_logprob": -0.1,
            "compression_ratio": 1.0,
            "no_speech_prob": 0.01,
            "words": [
                {"word": "Hello", "start": 0.0, "end": 0.5, "probability": 0.9},
                {"word": "there.", "start": 0.5, "end": 1.25, "probability": 0.8},
            ],
        },
        {
            "id": 1,
            "start": 3661.5,
            "end": 3662.004,
            "text": "General Kenobi.",
            "tokens": [3],
            "avg_logprob": -0.2,
            "compression_ratio": 1.1,
            "no_speech_prob": 0.02,
            "words": [],
        },
    ],
}


def test_json_is_text_and_duration_usage_rounded_up():
    body = json.loads(fmt.render(TRANSCRIPT, "json", ()))
    assert body == {"text": TRANSCRIPT["text"], "usage": {"type": "duration", "seconds": 3662}}


def test_text_ends_with_a_newline():
    assert fmt.render(TRANSCRIPT, "text", ()) == TRANSCRIPT["text"] + "\n"


def test_srt_numbers_cues_and_uses_commas():
    assert fmt.render(TRANSCRIPT, "srt", ()) == (
        "1\n00:00:00,000 --> 00:00:01,250\nHello there.\n\n"
        "2\n01:01:01,500 --> 01:01:02,004\nGeneral Kenobi.\n"
    )


def test_vtt_has_its_header_and_uses_dots():
    assert fmt.render(TRANSCRIPT, "vtt", ()) == (
        "WEBVTT\n\n"
        "00:00:00.000 --> 00:00:01.250\nHello there.\n\n"
        "01:01:01.500 --> 01:01:02.004\nGeneral Kenobi.\n"
    )


def test_verbose_json_lists_what_the_granularities_ask():
    both = json.loads(fmt.render(TRANSCRIPT, "verbose_json", ("segment", "word")))
    assert both["task"] == "transcribe" and both["language"] == "english"
    assert [s["text"] for s in both["segments"]] == [" Hello there.", " General Kenobi."]
    assert [w["word"] for w in both["words"]] == ["Hello", "there."]
    words_only = json.loads(fmt.render(TRANSCRIPT, "verbose_json", ("word",)))
    assert "segments" not in words_only and len(words_only["words"]) == 2


def test_no_segments_give_empty_subtitles():
    empty = {**TRANSCRIPT, "text": "", "segments": []}
    assert fmt.render(empty, "srt", ()) == ""
    assert fmt.render(empty, "vtt", ()) == "WEBVTT\n"
