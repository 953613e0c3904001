"""The tokenizer of a Hugging Face checkpoint folder: tokenizer.json (the `tokenizers` library),
its special tokens and chat template (tokenizer_config.json, or chat_template.jinja beside it).

Rendering follows transformers' `apply_chat_template`: a sandboxed jinja2 with `trim_blocks`,
`lstrip_blocks` and loop controls, the messages passed as given (content strings or lists of
parts: the template decides), the tokenizer's special tokens as variables. A rendered prompt is
encoded without adding special tokens (the template writes its own BOS, as transformers'
processors assume when the prompt starts with it).

Token bytes for the incremental detokenizer come from the byte-level vocabulary (GPT-2's
printable-character map, as Llama 3 and Qwen2 use); special tokens have none.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from omni_server.engine.errors import CheckpointError
from omni_server.engine.tokenizer import (
    ChatTemplateError,
    _byte_decoder,
    _raise_template_error,
    encode_releasing_gil,
)

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class HFTokenizer:
    def __init__(self, folder: Path | str, eos_token_ids: Iterable[int] = ()) -> None:
        """`eos_token_ids`: the ids that end a completion (generation_config.json's, which the
        checkpoint reader passes); the tokenizer's own eos_token when empty."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(folder, "no tokenizer.json")
        self._tokenizer = Tokenizer.from_file(str(path))
        settings = _read_json(folder / "tokenizer_config.json")
        vocab: dict[str, int] = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        added = self._tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, tok in added.items() if tok.special)
        self.special_tokens: dict[str, str] = {}
        for name in _SPECIAL_NAMES:
            value = settings.get(name)
            if isinstance(value, Mapping):  # a serialized AddedToken
                value = value.get("content")
            if isinstance(value, str):
                self.special_tokens[name] = value
        self.bos_token = self.special_tokens.get("bos_token", "")
        self.eos_token = self.special_tokens.get("eos_token", "")
        self.bos_token_id = vocab.get(self.bos_token) if self.bos_token else None
        self.eos_token_id = vocab.get(self.eos_token) if self.eos_token else None
        eos = frozenset(eos_token_ids)
        if not eos and self.eos_token_id is not None:
            eos = frozenset({self.eos_token_id})
        self.eos_token_ids = eos
        decoder = _byte_decoder()
        self._token_bytes: list[bytes] = [b""] * self.vocab_size
        for token, i in vocab.items():
            if i in self.special_ids:
                continue
            if i in added:  # a non-special added token is matched as its plain text
                self._token_bytes[i] = token.encode()
            elif all(c in decoder for c in token):
                self._token_bytes[i] = bytes(decoder[c] for c in token)
            else:
                self._token_bytes[i] = self._tokenizer.decode([i]).encode()
        self.max_token_chars = max(
            max((len(b) for b in self._token_bytes), default=1),
            max((len(added[i].content) for i in self.special_ids), default=1),
        )
        self.chat_template = _chat_template(folder, settings)
        self._template = None
        if self.chat_template is not None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added; special-token text maps to its one id."""
        return encode_releasing_gil(self._tokenizer, text)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def token_id(self, token: str) -> int | None:
        """The id of one token's text (e.g. "<|AUDIO_OUT|>"); None if not in the vocabulary."""
        found: int | None = self._tokenizer.token_to_id(token)
        return found

    def token_bytes(self, token_id: int) -> bytes:
        return self._token_bytes[token_id]

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for `messages`, rendered as transformers renders it."""
        if self._template is None:
            raise ChatTemplateError("this checkpoint's tokenizer has no chat template")
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except TemplateError as err:
            raise ChatTemplateError(f"chat template: {err}") from err

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=True))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(path.parent, f"{path.name} is not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise CheckpointError(path.parent, f"{path.name} is not a JSON object")
    return data


def _chat_template(folder: Path, settings: Mapping[str, Any]) -> str | None:
    """chat_template.jinja (transformers 5 saves it beside the tokenizer), else the one in
    tokenizer_config.json, else a processor's chat_template.json."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = settings.get("chat_template")
    if isinstance(template, str):
        return template
    template = _read_json(folder / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None
