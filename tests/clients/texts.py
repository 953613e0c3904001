"""Texts the client tests speak."""

# a few sentences: the server streams one chunk per sentence at least
SENTENCES = "The quick brown fox jumps over the lazy dog. It was not amused. Then it slept."
