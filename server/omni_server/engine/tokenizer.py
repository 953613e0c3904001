"""The tokenizer a GGUF carries: byte-level BPE from its vocab + merges, its chat template.

Built with `tokenizers` from `tokenizer.ggml.tokens` / `merges` / `token_type`. The split before
BPE follows the file's `tokenizer.ggml.pre`: for "smollm" (and the GPT-2 family) each digit is
its own piece, then GPT-2's byte-level regex. Control tokens (`<|im_start|>`, `<|im_end|>`, ...)
are special tokens: matched whole in text, left out of decoded text.

`IncrementalDetokenizer` turns a token stream into text deltas that never end inside a UTF-8
character: it keeps the raw bytes of each token and an incremental UTF-8 decoder holds back an
incomplete trailing sequence until the next token completes it.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any, Protocol

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CONTROL = 3  # llama.cpp token types
USER_DEFINED = 4
_DIGIT_SPLIT_PRE = {"smollm", "gpt2", "default", "starcoder", "refact"}


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character -> byte map (inverse of its bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def encode_releasing_gil(tokenizer: Tokenizer, text: str) -> list[int]:
    """`text`'s ids, no special tokens added. `Tokenizer.encode` holds the GIL for the whole
    text (seconds for a megabyte on a busy core: no other thread of the process runs meanwhile,
    a stage's heartbeat included); `encode_batch` releases it while Rust works."""
    ids: list[int] = tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
    return ids


class ChatTemplateError(ValueError):
    """The messages cannot be rendered by the model's chat template (message says why)."""


class TextTokenizer(Protocol):
    """What the engine needs of a tokenizer: GGUFTokenizer (a GGUF's) or HFTokenizer (a
    checkpoint folder's tokenizer.json, engine/hf_tokenizer.py)."""

    vocab_size: int
    eos_token_ids: frozenset[int]
    # the most characters one token stands for (special tokens' text included): a text of
    # more than max_tokens * max_token_chars characters cannot fit in max_tokens tokens
    max_token_chars: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]: ...


class GGUFTokenizer:
    def __init__(self, metadata: Mapping[str, Any]) -> None:
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model {model!r} unsupported (byte-level BPE only)")
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        tokenizer = Tokenizer(bpe)
        pieces: list[pre_tokenizers.PreTokenizer] = []
        if metadata.get("tokenizer.ggml.pre", "default") in _DIGIT_SPLIT_PRE:
            pieces.append(pre_tokenizers.Digits(individual_digits=True))
        pieces.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(pieces)
        tokenizer.decoder = decoders.ByteLevel()
        special = [tokens[i] for i, t in enumerate(types) if t == CONTROL]
        tokenizer.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in special]
        )
        user = [tokens[i] for i, t in enumerate(types) if t == USER_DEFINED]
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
        self._tokenizer = tokenizer
        self.vocab_size = len(tokens)
        self.special_ids = frozenset(i for i, t in enumerate(types) if t == CONTROL)
        self.bos_token_id: int | None = metadata.get("tokenizer.ggml.bos_token_id")
        self.eos_token_id: int | None = metadata.get("tokenizer.ggml.eos_token_id")
        self.bos_token = tokens[self.bos_token_id] if self.bos_token_id is not None else ""
        self.eos_token = tokens[self.eos_token_id] if self.eos_token_id is not None else ""
        self.add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        self.eos_token_ids = frozenset({self.eos_token_id} if self.eos_token_id is not None else ())
        # Raw bytes of each token, for the incremental detokenizer (special tokens: none).
        decoder = _byte_decoder()
        self._token_bytes: list[bytes] = [
            b"" if i in self.special_ids else bytes(decoder[c] for c in tok if c in decoder)
            for i, tok in enumerate(tokens)
        ]
        # a byte-level token's string has one character per byte, and a UTF-8 character is
        # at least one byte; a special token's string is its text
        self.max_token_chars = max(len(t) for t in tokens)
        template = metadata.get("tokenizer.chat_template")
        self.chat_template: str | None = template
        self._template = None
        if template is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(template)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token text (e.g. `<|im_start|>`) maps to its one id."""
        ids = encode_releasing_gil(self._tokenizer, text)
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        return self._token_bytes[token_id]

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for `messages` (`role` + `content`: a string or a list of text parts)."""
        if self._template is None:
            raise ChatTemplateError("this model's GGUF has no tokenizer.chat_template")
        flat = [{**m, "content": _text_content(m.get("content"))} for m in messages]
        try:
            return self._template.render(
                messages=flat,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as err:
            raise ChatTemplateError(f"chat template: {err}") from err

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=True))


def _text_content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                raise ChatTemplateError(
                    "message content parts must be {'type': 'text', 'text': ...}"
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    if content is None:
        return ""
    raise ChatTemplateError(
        f"message content must be a string or a list of text parts: {content!r}"
    )


def _raise_template_error(message: str) -> None:
    raise ChatTemplateError(message)


class IncrementalDetokenizer:
    """Token ids in, text deltas out; a delta never ends inside a UTF-8 character."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """What is left at the end (an incomplete trailing sequence becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)
