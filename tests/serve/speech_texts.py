"""Texts the serving tests speak, with rough bounds on how long they may plausibly last."""

from __future__ import annotations

ONE_SENTENCE = "The quick brown fox jumps over the lazy dog."
THREE_SENTENCES = (
    "The quick brown fox jumps over the lazy dog. "
    "A journey of a thousand miles begins with a single step. "
    "Bright stars shine over the quiet harbor tonight."
)
# Long enough that a client can leave long before the pipeline is done with it.
MANY_SENTENCES = " ".join(
    f"This is sentence number {n} of a passage that keeps the voice busy." for n in range(1, 25)
)


def plausible_seconds(text: str) -> tuple[float, float]:
    """Bounds for a normal-speed reading: English speech runs at about 2 to 4 words a second."""
    words = len(text.split())
    return words / 5.0, words / 1.2
