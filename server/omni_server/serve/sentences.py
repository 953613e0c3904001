"""Streamed text cut into sentences as soon as each is complete, for the speech input stream.

A sentence is complete once the text after it has begun: a `.`, `!` or `?` (closing quotes and
brackets after it), whitespace, then a character that is not lower-case. The lookahead keeps
"etc. and so on" whole, and a period after a title or a single initial ("Dr. Smith",
"J. Smith") is no end either. A blank line ends a paragraph and so a sentence. Text that runs
on without an end is cut at its last space once it passes `max_chars`, so one "sentence" never
waits for the whole buffer (nor makes one very long request).

Only where to cut is decided here; the voice's text frontend still splits and phonemizes each
piece as the speech endpoint's input, so a cut a little early costs at most a pause.
"""

from __future__ import annotations

import re
import unicodedata

# the end, then the first character of what follows (not consumed: it starts the next one)
_CLOSERS = "\"')\\]\u201d\u2019"  # closing quotes and brackets after an end
_END = re.compile(rf"(?:[.!?]+[{_CLOSERS}]*\s+(?=\S)|\n\s*\n\s*(?=\S))")
_TITLES = frozenset(
    [
        "mr",
        "mrs",
        "ms",
        "dr",
        "prof",
        "st",
        "jr",
        "sr",
        "vs",
        "etc",
        "e.g",
        "i.e",
        "no",
        "fig",
        "approx",
        "dept",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
    ]
)
_WORD_BEFORE = re.compile(rf"([\w.]+)[.!?]*[{_CLOSERS}]*\s*$")
SPEAKABLE_CATEGORIES = frozenset("LNS")  # as the speech endpoint: letters, numbers, symbols


def speakable(text: str) -> bool:
    """The text has something a voice can say (not only punctuation, spaces, marks)."""
    return any(unicodedata.category(c)[0] in SPEAKABLE_CATEGORIES for c in text)


class SentenceBuffer:
    """Text in pieces -> complete sentences out; what is not yet complete stays pending."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self._pending = ""

    @property
    def pending(self) -> int:
        return len(self._pending)

    def push(self, piece: str) -> list[str]:
        """Add a piece of text; returns the sentences it completed (often none)."""
        self._pending += piece
        sentences: list[str] = []
        start = 0
        for match in _END.finditer(self._pending):
            if not self._ends_sentence(self._pending, match):
                continue
            sentences.append(self._pending[start : match.end()].strip())
            start = match.end()
        self._pending = self._pending[start:]
        while len(self._pending) > self.max_chars:
            cut = self._pending.rfind(" ", 0, self.max_chars)
            cut = cut if cut > 0 else self.max_chars
            sentences.append(self._pending[:cut].strip())
            self._pending = self._pending[cut:].lstrip()
        return [s for s in sentences if s]

    def flush(self) -> str:
        """Everything pending, complete or not (a flush, or the end of the text)."""
        rest, self._pending = self._pending.strip(), ""
        return rest

    def clear(self) -> None:
        self._pending = ""

    @staticmethod
    def _ends_sentence(text: str, match: re.Match[str]) -> bool:
        following = text[match.end() : match.end() + 1]
        if following.islower():
            return False  # "etc. and", "e.g. this": the sentence goes on
        if text[match.start()] in "!?" or text[match.start()] == "\n":
            return True
        word = _WORD_BEFORE.search(text[: match.end()])
        if word is None:
            return True
        before = word.group(1).lower().rstrip(".")
        return before not in _TITLES and not (len(before) == 1 and before.isalpha())
