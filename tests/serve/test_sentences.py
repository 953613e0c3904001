"""Where the speech input stream cuts streamed text into sentences (serve/sentences.py)."""

from __future__ import annotations

import random

import pytest

from omni_server.serve.sentences import SentenceBuffer, speakable

TEXT = (
    'Dr. Smith arrived at 3 p.m. and said "Hello!" Then J. R. Tolkien, etc. and so on, wrote '
    "more. Is it late? Yes.\n\nA new paragraph starts here"
)
SENTENCES = [
    'Dr. Smith arrived at 3 p.m. and said "Hello!"',
    "Then J. R. Tolkien, etc. and so on, wrote more.",
    "Is it late?",
    "Yes.",
]


def _split(pieces: list[str]) -> tuple[list[str], str]:
    buffer = SentenceBuffer(400)
    out = [s for piece in pieces for s in buffer.push(piece)]
    return out, buffer.flush()


def test_sentences_leave_once_the_text_after_them_has_begun():
    buffer = SentenceBuffer(400)
    assert buffer.push("Hello there.") == []  # what follows may still make it "there.com"
    assert buffer.push(" ") == []
    assert buffer.push("How") == ["Hello there."]
    assert buffer.flush() == "How"


@pytest.mark.parametrize("seed", range(5))
def test_any_split_of_the_text_gives_the_same_sentences(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TEXT)), 12))
    pieces = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)], strict=True)]
    assert _split(pieces) == (SENTENCES, "A new paragraph starts here")
    assert _split([TEXT]) == (SENTENCES, "A new paragraph starts here")


def test_run_on_text_is_cut_at_a_space_past_the_limit():
    buffer = SentenceBuffer(40)
    out = buffer.push("word " * 30)
    assert out and all(len(s) <= 40 for s in out)
    assert " ".join([*out, buffer.flush()]).split() == ["word"] * 30


def test_speakable():
    assert speakable("3 $") and speakable("héllo")
    assert not speakable("... !? \u200b")
