"""Errors the engine raises for a request or a checkpoint it cannot take (ValueError subclasses:
the server maps a request's to HTTP 400, a stage reports a checkpoint's as its start error)."""

from __future__ import annotations


class ContextLengthExceeded(ValueError):
    """The prompt (+ requested completion) can never fit this engine's context window.

    The server answers HTTP 400 with code `context_length_exceeded`. Raised by `Engine.add`, before
    the request takes any resource, so the request simply does not exist afterwards.
    """

    code = "context_length_exceeded"

    def __init__(self, prompt_tokens: int, max_tokens: int | None, max_seq_len: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_seq_len = max_seq_len
        asked = prompt_tokens + (max_tokens or 1)
        completion = f"{max_tokens} in the completion" if max_tokens else "at least 1 to generate"
        super().__init__(
            f"This model's maximum context length is {max_seq_len} tokens. However, you requested "
            f"{asked} tokens ({prompt_tokens} in the messages, {completion}). Please reduce the "
            "length of the messages or completion."
        )


class CheckpointError(ValueError):
    """A checkpoint folder the engine cannot load: no config.json, an unknown `model_type`, weights
    whose names or shapes disagree with the config, a missing tokenizer. One line that names the
    folder and what is wrong (raised before any weight is placed)."""

    def __init__(self, folder: object, problem: str) -> None:
        self.folder = str(folder)
        self.problem = problem
        super().__init__(f"checkpoint {self.folder}: {problem}")
