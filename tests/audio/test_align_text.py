"""The forced aligner's text side (omni_server.audio.align_text): which words a text has, how
many of them a recognizer's hypothesis covers, and the timing contract it builds."""

from __future__ import annotations

from omni_server.audio.align_text import (
    covered_words,
    monotonic,
    normalized,
    spoken_words,
    timing_of,
)
from omni_server.contracts import SpeechTiming


def test_words_leave_out_the_punctuation_around_them() -> None:
    text = '"Well," she said -- it\'s state-of-the-art!'
    words = spoken_words(text)
    assert [w.text for w in words] == ["Well", "she", "said", "it's", "state-of-the-art"]
    assert all(text[w.char_start : w.char_end] == w.text for w in words)


def test_a_hypothesis_covers_the_prefix_it_speaks() -> None:
    text = [normalized(w.text) for w in spoken_words("The quick brown fox jumps over the dog.")]
    assert covered_words(text, ["the", "quick", "brown"]) == 3
    # misheard and dropped words still mark how far the audio got
    assert covered_words(text, ["a", "quik", "fox"]) == 4
    assert covered_words(text, ["the", "quick", "brown", "fox", "jumps", "over", "the", "dog"]) == 8
    assert covered_words(text, []) == 0


def test_times_are_made_monotonic_inside_the_segment() -> None:
    assert monotonic([(0.5, 0.4), (0.3, 0.9), (1.2, 2.0)], 1.5) == [
        (0.5, 0.5), (0.5, 0.9), (1.2, 1.5),
    ]  # fmt: skip


def test_timings_of_consecutive_spans_join_into_the_text() -> None:
    text = "Hello, world. Bye!"
    words = spoken_words(text)
    first = timing_of(text, words[:2], [(0.0, 0.4), (0.5, 0.9)], (0, words[2].char_start))
    last = timing_of(text, words[2:], [(1.2, 1.5)], (words[2].char_start, len(text)))
    joined = SpeechTiming.joined([first, last])
    assert joined.text == text
    assert [(w.text, w.start_s, w.end_s) for w in joined.words] == [
        ("Hello", 0.0, 0.4), ("world", 0.5, 0.9), ("Bye", 1.2, 1.5),
    ]  # fmt: skip
    # the comma and space between two words take the gap between them
    assert joined.character_start_times_seconds[5] == 0.4
    assert joined.character_end_times_seconds[6] == 0.5
