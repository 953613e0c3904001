"""The words of a text to speak, and their timing as the speech contract carries it.

A forced aligner (audio/forced_alignment.py) times the words of the text a voice was given;
this module says what those words are (`spoken_words`: runs of non-space characters with a
letter or digit in them, the punctuation around them left out), how many of them a recognizer's
hypothesis covers (`covered_words`: an edit-distance alignment that lets the text run on past
the audio), and turns word times into the `SpeechTiming` contract (`timing_of`): the characters
between words take the gap between them, a word's characters share its time evenly.

No model here: pure functions of strings and numbers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher

from omni_server.contracts import SpeechTiming, WordTiming

# a word: non-space characters with a letter or digit, without the punctuation around it
# ("dog," -> "dog", "'quoted'" -> "quoted", "don't" and "state-of-the-art" stay whole)
_TOKEN = re.compile(r"\S+")
_EDGE = re.compile(r"^[^\w]+|[^\w]+$")


@dataclass(frozen=True)
class Word:
    """One word of the text: `text == source[char_start:char_end]`."""

    text: str
    char_start: int
    char_end: int


def spoken_words(text: str) -> list[Word]:
    """The words of `text` in order (a token of punctuation alone is no word)."""
    words = []
    for token in _TOKEN.finditer(text):
        core = _EDGE.sub("", token.group())
        if not core:
            continue
        start = token.start() + token.group().index(core)
        words.append(Word(core, start, start + len(core)))
    return words


def normalized(word: str) -> str:
    """How two spellings of a word compare: lower case, letters and digits only."""
    return "".join(c for c in word.lower() if c.isalnum())


def _substitution(a: str, b: str) -> float:
    """0 for the same word, less than 1 for a near spelling (a misheard word), 1 otherwise
    (as Levenshtein's: a word's mere letters in common are no evidence)."""
    if a == b:
        return 0.0
    similarity = SequenceMatcher(None, a, b).ratio()
    return 1.0 - similarity if similarity >= 0.5 else 1.0


def covered_words(reference: Sequence[str], hypothesis: Sequence[str]) -> int:
    """How many words at the start of `reference` the recognized `hypothesis` speaks.

    Levenshtein over words (insertions and deletions cost 1, a substitution 1 or less for a
    near spelling), the whole hypothesis against a prefix of the reference of any length: the
    prefix that costs least (the longer one on a tie). Both are normalized words."""
    n, m = len(hypothesis), len(reference)
    if n == 0 or m == 0:
        return 0
    previous = [float(j) for j in range(m + 1)]  # row i: hypothesis[:i] against reference[:j]
    for i in range(1, n + 1):
        row = [float(i)] + [0.0] * m
        for j in range(1, m + 1):
            row[j] = min(
                previous[j] + 1.0,  # a word Whisper heard that the text does not have
                row[j - 1] + 1.0,  # a word of the text Whisper did not hear
                previous[j - 1] + _substitution(hypothesis[i - 1], reference[j - 1]),
            )
        previous = row
    best = min(previous[1:])
    return max(j for j in range(1, m + 1) if previous[j] == best)


def monotonic(times: Sequence[tuple[float, float]], limit: float) -> list[tuple[float, float]]:
    """Word times made safe to send: in 0..limit, each start at or after the one before,
    each end at or after its start (an aligner's rounding can break any of these)."""
    out: list[tuple[float, float]] = []
    floor = 0.0
    for start, end in times:
        start = min(max(start, floor), limit)
        end = min(max(end, start), limit)
        out.append((start, end))
        floor = start
    return out


def timing_of(
    text: str,
    words: Sequence[Word],
    times: Sequence[tuple[float, float]],
    span: tuple[int, int],
) -> SpeechTiming:
    """The timing of `text[span[0]:span[1]]`, which holds `words` (their offsets are into
    `text`) timed `times` (seconds from the utterance's first sample).

    Consecutive spans joined (`SpeechTiming.joined`) give the whole text. A word's characters
    share its time evenly; the characters before the first word start with it, those between
    two words take the gap between them, those after the last end with it."""
    begin, end = span
    characters = text[begin:end]
    starts = [0.0] * len(characters)
    ends = [0.0] * len(characters)
    timed: list[WordTiming] = []
    cursor = begin  # the first character not yet timed
    previous_end = times[0][0] if times else 0.0
    for word, (start_s, end_s) in zip(words, times, strict=True):
        for c in range(cursor, word.char_start):  # the gap before this word
            starts[c - begin], ends[c - begin] = previous_end, start_s
        step = (end_s - start_s) / len(word.text)
        for k in range(len(word.text)):
            c = word.char_start + k - begin
            starts[c] = start_s + k * step
            ends[c] = start_s + (k + 1) * step
        ends[word.char_end - 1 - begin] = end_s  # exactly, whatever the rounding
        timed.append(
            WordTiming(word.text, start_s, end_s, word.char_start - begin, word.char_end - begin)
        )
        cursor, previous_end = word.char_end, end_s
    for c in range(cursor, end):  # after the last word: none of the gap is known yet
        starts[c - begin] = ends[c - begin] = previous_end
    return SpeechTiming(
        characters=tuple(characters),
        character_start_times_seconds=tuple(starts),
        character_end_times_seconds=tuple(ends),
        words=tuple(timed),
    )
