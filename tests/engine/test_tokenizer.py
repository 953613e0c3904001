"""The GGUF's tokenizer and chat template against transformers' reading of the same file."""

from __future__ import annotations

import pytest

from omni_server.engine.tokenizer import ChatTemplateError, GGUFTokenizer, IncrementalDetokenizer

TEXTS = [
    "Hello world",
    "  leading spaces and trailing  ",
    "Numbers 12345 and 3.14159, dates 2026-11-30.",
    "Unicode: héllo wörld, naïve café, 日本語のテキスト, emoji 🎉🚀👍🏽",
    "Code:\n\tdef f(x):\n\t\treturn x ** 2  # square\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n",
    "don't can't I'll we've they're",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Where is the treasure?"},
    ],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And times 3?"},
    ],
]


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_transformers(tokenizer: GGUFTokenizer, hf_tokenizer, text: str) -> None:
    assert tokenizer.encode(text) == hf_tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(tokenizer: GGUFTokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_and_eos(tokenizer: GGUFTokenizer) -> None:
    assert tokenizer.encode("<|im_end|>") == [tokenizer.eos_token_id]
    assert tokenizer.eos_token == "<|im_end|>"
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>")
    assert tokenizer.decode(ids) == "hi"  # special tokens are left out of text


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(
    tokenizer: GGUFTokenizer, hf_tokenizer, messages: list, add_generation_prompt: bool
) -> None:
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert ours == theirs


def test_chat_content_parts_flatten(tokenizer: GGUFTokenizer) -> None:
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}
    ]
    plain = [{"role": "user", "content": "Hi!"}]
    assert tokenizer.apply_chat_template(parts) == tokenizer.apply_chat_template(plain)
    with pytest.raises(ChatTemplateError, match="content parts"):
        tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])


@pytest.mark.parametrize("text", [TEXTS[3], "€€€ ∑ ∞ ✓ Ωmega", "ẞ🇫🇷🏳️‍🌈 ok"])
def test_incremental_detokenizer_never_breaks_utf8(tokenizer: GGUFTokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(i) for i in ids]
    tail = detok.flush()
    assert tail == ""
    for delta in deltas:
        assert "\ufffd" not in delta
        delta.encode("utf-8")  # a lone surrogate or broken sequence would raise
    assert "".join(deltas) == text == tokenizer.decode(ids)
    # Multi-byte characters span several byte-level tokens here: some steps must hold text back.
    assert any(d == "" for d in deltas)


def test_incremental_detokenizer_flushes_incomplete_tail(tokenizer: GGUFTokenizer) -> None:
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1  # the emoji's bytes are split over tokens
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.flush() == "\ufffd"  # cut short: one replacement char, never raw bytes
