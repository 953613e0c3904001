"""A voice's timing as the `contracts.SpeechTiming` its audio chunks carry: from each word's
start and end (a duration model's frames, or a forced alignment) to ElevenLabs' per-character
arrays.

Inside a word its characters share its time evenly (a voice times sounds, not letters); the
spaces and punctuation between two words share the gap between them (none when the words
touch), those before the first word the time from the chunk's start, those after the last the
time to the chunk's end. Times are seconds from the utterance's first sample, as the contract
says.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omni_server.contracts import SpeechTiming, WordTiming

# [char_start, char_end, start_s, end_s]: one word's characters in a text and when it plays
TimedSpan = tuple[int, int, float, float]


def frames_to_spans(
    words: Sequence[Sequence[int]], durations: np.ndarray, frame_s: float, offset_s: float
) -> list[TimedSpan]:
    """Words timed by a duration model: `words` are [char_start, char_end, id_start, id_stop]
    (a word's phoneme ids), `durations` the frames of each id ([ids]), `frame_s` the seconds
    of one frame at the voice's rate (hop / rate), `offset_s` when the sentence starts."""
    ends = np.concatenate([[0.0], np.cumsum(durations, dtype=np.float64)])  # [ids + 1] frames
    last = len(durations)
    return [
        (
            int(c0),
            int(c1),
            offset_s + float(ends[min(int(i0), last)]) * frame_s,
            offset_s + float(ends[min(int(i1), last)]) * frame_s,
        )
        for c0, c1, i0, i1 in words
    ]


def speech_timing(
    text: str, spans: Sequence[TimedSpan], start_s: float, end_s: float
) -> SpeechTiming:
    """The timing of `text`, a chunk's characters played from `start_s` to `end_s`, whose
    words are `spans` (in order, inside the chunk's time; see the module docstring)."""
    starts = [0.0] * len(text)
    ends = [0.0] * len(text)
    words: list[WordTiming] = []
    cursor_char, cursor_s = 0, start_s
    for c0, c1, w0, w1 in [*spans, (len(text), len(text), end_s, end_s)]:
        w0 = min(max(w0, cursor_s), end_s)
        w1 = min(max(w1, w0), end_s)
        _spread(starts, ends, cursor_char, c0, cursor_s, w0)  # the gap before the word
        _spread(starts, ends, c0, c1, w0, w1)
        if c1 > c0:
            words.append(WordTiming(text[c0:c1], w0, w1, c0, c1))
        cursor_char, cursor_s = c1, w1
    return SpeechTiming(tuple(text), tuple(starts), tuple(ends), tuple(words))


def _spread(starts: list[float], ends: list[float], c0: int, c1: int, t0: float, t1: float) -> None:
    """Characters [c0, c1) share [t0, t1) evenly."""
    count = c1 - c0
    for k in range(count):
        starts[c0 + k] = t0 + (t1 - t0) * k / count
        ends[c0 + k] = t0 + (t1 - t0) * (k + 1) / count


def split_timing(timing: SpeechTiming, at_s: float) -> tuple[SpeechTiming, SpeechTiming]:
    """A timing cut where its audio is cut, at `at_s`: the words starting before it and the
    characters up to the first word after it, then the rest (each word whole, in one part)."""
    later = [w for w in timing.words if w.start_s >= at_s]
    cut = later[0].char_start if later else len(timing.characters)
    head_words = tuple(w for w in timing.words if w.start_s < at_s)
    rest_words = tuple(
        WordTiming(w.text, w.start_s, w.end_s, w.char_start - cut, w.char_end - cut) for w in later
    )
    starts, ends = timing.character_start_times_seconds, timing.character_end_times_seconds
    head = SpeechTiming(timing.characters[:cut], starts[:cut], ends[:cut], head_words)
    rest = SpeechTiming(timing.characters[cut:], starts[cut:], ends[cut:], rest_words)
    return head, rest
