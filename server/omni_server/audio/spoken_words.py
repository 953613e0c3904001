"""Which words of a text a voice's phoneme words speak: the link from a phonemizer's output
back to the characters the caller wrote, so a voice's durations can time each word.

A phonemizer (espeak-ng) does not map its output to its input: it merges words ("of the" ->
one phoneme word, "I am" too), splits them ("42" -> two: forty two) and drops some ("-"). So the
text's words are matched to the phoneme words by a small dynamic program: each text word is
phonemized alone once (how many phoneme words and how many phonemes it makes), and groups of
up to MAX_GROUP text words are matched to groups of up to MAX_GROUP phoneme words at the least
cost (words made against words found, phonemes made against phonemes found). Inside a group
the phonemes are shared by the text words in proportion to the phonemes each makes alone.

`TextWords` consumes its text sentence by sentence, in order: `match(phonemes)` takes the next
sentence's phoneme symbols (words separated by " ") and returns its `SpokenWord`s, each the
text's characters [char_start, char_end) and the sentence's phonemes [phoneme_start,
phoneme_stop) that speak them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from difflib import SequenceMatcher

MAX_GROUP = 3  # "of the way" -> one phoneme word is the longest merge espeak-ng makes here
# How many text words past a sentence's phoneme words its match may reach: merges make a
# sentence's text longer (in words) than its phonemes, never by more than this share.
WINDOW = 2
_TOKEN = re.compile(r"\S+")
_EDGE = re.compile(r"^[^\w]+|[^\w]+$")  # punctuation around a word, not part of its text
STRESS = frozenset("ˈˌ")
PAUSES = frozenset(",.;:!?")  # clause terminators Piper appends to a clause's last word


@dataclass(frozen=True)
class SpokenWord:
    text: str  # the characters as written, trimmed of surrounding punctuation
    char_start: int  # in TextWords' text
    char_end: int
    phoneme_start: int  # in the sentence's phoneme symbols
    phoneme_stop: int


@dataclass(frozen=True)
class _TextWord:
    start: int
    end: int
    words: int  # phoneme words it makes alone
    sounds: str  # its sounding phoneme symbols alone (no stress, no pauses)

    @property
    def phonemes(self) -> int:
        return len(self.sounds)


@dataclass(frozen=True)
class _PhonemeWord:
    start: int  # symbol index in the sentence
    stop: int  # past its last sounding symbol (a trailing pause left out)
    sounds: str

    @property
    def phonemes(self) -> int:
        return len(self.sounds)


def _sounding(symbols: str | list[str]) -> str:
    return "".join(s for s in symbols if s not in STRESS and s not in PAUSES and not s.isspace())


def phoneme_words(symbols: list[str]) -> list[_PhonemeWord]:
    """The words of a sentence's phoneme symbols (separated by " ")."""
    found: list[_PhonemeWord] = []
    start = None
    for index, symbol in enumerate([*symbols, " "]):
        if symbol != " " and start is None:
            start = index
        elif symbol == " " and start is not None:
            stop = index
            while stop > start and symbols[stop - 1] in PAUSES:
                stop -= 1
            if stop > start:
                found.append(_PhonemeWord(start, stop, _sounding(symbols[start:stop])))
            start = None
    return found


class TextWords:
    """A text's words, matched to its sentences' phonemes in order (see the module docstring).

    `phonemize(word)` is the voice's phonemizer on one word alone: its phoneme words, as one
    string separated by spaces ("" for a word it does not speak)."""

    def __init__(self, text: str, phonemize: Callable[[str], str]) -> None:
        self.text = text
        self._words: list[_TextWord] = []
        for token in _TOKEN.finditer(text):
            spoken = phonemize(token.group()).split()
            if not spoken:
                continue  # "-", "..." : nothing spoken
            trimmed = _EDGE.sub("", token.group()) or token.group()
            start = token.start() + token.group().find(trimmed)
            self._words.append(
                _TextWord(start, start + len(trimmed), len(spoken), _sounding("".join(spoken)))
            )
        self._next = 0  # the first text word no sentence has matched yet

    def match(self, symbols: list[str]) -> list[SpokenWord]:
        """The next sentence's words: the text words its phoneme symbols speak."""
        found = phoneme_words(symbols)
        window = self._words[self._next : self._next + WINDOW * len(found) + MAX_GROUP]
        groups = _align(window, found)
        spoken: list[SpokenWord] = []
        for (a0, a1), (b0, b1) in groups:
            text_words = window[a0:a1]
            if b1 == b0:
                continue  # nothing of this sentence speaks them (a phonemizer's surprise)
            spoken.extend(self._share(text_words, found[b0:b1], symbols))
        self._next += max((a1 for (_, a1), _ in groups), default=0)
        return spoken

    def _share(
        self, text_words: list[_TextWord], spoken: list[_PhonemeWord], symbols: list[str]
    ) -> list[SpokenWord]:
        """Text words sharing phoneme words: whole phoneme words when the counts agree, else
        the group's sounding symbols cut in proportion to what each text word makes alone."""
        if len(text_words) == len(spoken) or len(text_words) == 1:
            pairs = (
                zip(text_words, [(p.start, p.stop) for p in spoken], strict=True)
                if len(text_words) == len(spoken)
                else [(text_words[0], (spoken[0].start, spoken[-1].stop))]
            )
            return [self._word(w, start, stop) for w, (start, stop) in pairs]
        positions = [
            i
            for p in spoken
            for i in range(p.start, p.stop)
            if symbols[i] not in STRESS and symbols[i] not in PAUSES and symbols[i] != " "
        ]
        total = sum(w.phonemes for w in text_words) or len(text_words)
        out: list[SpokenWord] = []
        made = 0
        cut = spoken[0].start
        for k, word in enumerate(text_words):
            made += word.phonemes or 1
            last = len(text_words) - 1 == k
            share = len(positions) if last else round(len(positions) * made / total)
            stop = spoken[-1].stop if last or share >= len(positions) else positions[share]
            stop = max(stop, cut)
            out.append(self._word(word, cut, stop))
            cut = stop
        return out

    def _word(self, word: _TextWord, start: int, stop: int) -> SpokenWord:
        return SpokenWord(self.text[word.start : word.end], word.start, word.end, start, stop)

    def chunk_end(self) -> int:
        """Where the text of the sentence matched last ends: at the next text
        word still unmatched (the spaces and punctuation between belong to the sentence
        before), or the text's end."""
        if self._next < len(self._words):
            return self._words[self._next].start
        return len(self.text)


def _cost(text_words: list[_TextWord], spoken: list[_PhonemeWord]) -> float:
    """How unlike the group's phonemes alone are to the phonemes found: the sounds (a
    multiset overlap: cheap, and merges change few sounds), then the word count (merges and
    splits are common, so it weighs less), then a small price per extra word in the group."""
    made = "".join(w.sounds for w in text_words)
    found = "".join(p.sounds for p in spoken)
    sounds = 1.0 - SequenceMatcher(None, made, found, autojunk=False).quick_ratio()
    words = abs(sum(w.words for w in text_words) - len(spoken))
    return 2.0 * sounds + 0.3 * words + 0.1 * (len(text_words) + len(spoken) - 2)


def _align(
    text_words: list[_TextWord], spoken: list[_PhonemeWord]
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The least-cost grouping of all of `spoken` with a prefix of `text_words`: groups of
    1..MAX_GROUP text words with 1..MAX_GROUP phoneme words (or a phoneme word with none,
    at a high cost, so a match always exists)."""
    n, m = len(text_words), len(spoken)
    inf = float("inf")
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    back: list[list[tuple[int, int] | None]] = [[None] * (m + 1) for _ in range(n + 1)]
    cost[0][0] = 0.0
    for a in range(n + 1):
        for b in range(m + 1):
            here = cost[a][b]
            if here == inf:
                continue
            if b < m and here + 3.0 < cost[a][b + 1]:  # a phoneme word of no text word
                cost[a][b + 1], back[a][b + 1] = here + 3.0, (a, b)
            for da in range(1, MAX_GROUP + 1):
                for db in range(1, MAX_GROUP + 1):
                    if a + da > n or b + db > m:
                        continue
                    total = here + _cost(text_words[a : a + da], spoken[b : b + db])
                    if total < cost[a + da][b + db]:
                        cost[a + da][b + db], back[a + da][b + db] = total, (a, b)
    end = min(range(n + 1), key=lambda a: cost[a][m])
    groups: list[tuple[tuple[int, int], tuple[int, int]]] = []
    a, b = end, m
    while (a, b) != (0, 0):
        prev = back[a][b]
        assert prev is not None  # every reached cell has a way back to (0, 0)
        groups.append(((prev[0], a), (prev[1], b)))
        a, b = prev
    return groups[::-1]
