"""What Qwen3-Omni's thinker stage streams to its talker stage: the one typed edge between the
model's two halves (examples/qwen3-omni/).

The talker hears the user's turns and the thinker's answer (talker_input.py says how it builds
its prompt from them). It needs the prompt's ids (it embeds text itself, with the thinker's
embedding table), the thinker's layer-`accept_hidden_layer` output at the prompt's multimodal
placeholders (audio, image, video: the only positions whose embedding is not a token's), and the
generated ids as they come. Nothing else crosses: no logits, no hidden state of a text position
(the payload projection the reference design asks for: a stage gets what it reads).

    first chunk      TalkerOpening   once, before or with the first generated id
    every chunk      ThinkerTokens   the ids generated since the last chunk, in order; the
                                     last chunk has done=True (the final id, usually the end
                                     of turn, included)

Both are checked again when decoded from shared memory (Contract.__reduce__).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from omni_server.contracts import Contract, SpeechOptions

MAX_PROMPT_IDS = 1 << 20
MAX_TOKEN_ID = 1 << 24


def _check_ids(name: str, ids: Any) -> None:
    if not isinstance(ids, tuple) or len(ids) > MAX_PROMPT_IDS:
        raise ValueError(f"{name} must be a tuple of at most {MAX_PROMPT_IDS} token ids")
    for token in ids:
        if not (isinstance(token, int) and not isinstance(token, bool)):
            raise ValueError(f"{name} must hold ints; found {type(token).__name__}")
        if not 0 <= token < MAX_TOKEN_ID:
            raise ValueError(f"{name} holds {token}, outside 0..{MAX_TOKEN_ID - 1}")


@dataclass(frozen=True)
class TalkerOpening(Contract):
    """The talker's view of the prompt, and the voice to answer in."""

    KEY: ClassVar[str] = "talker_opening"
    STAGES_ONLY: ClassVar[bool] = True  # the talker's; never the caller's

    prompt_ids: tuple[int, ...]
    # [M, thinker hidden] floating: the thinker's layer-accept_hidden_layer output at the M
    # multimodal placeholder positions of prompt_ids, in prompt order (M may be 0)
    multimodal_hidden: torch.Tensor
    speech: SpeechOptions

    def __post_init__(self) -> None:
        _check_ids("prompt_ids", self.prompt_ids)
        if not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        hidden = self.multimodal_hidden
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
            raise ValueError("multimodal_hidden must be a 2-D tensor [M, hidden]")
        if not hidden.is_floating_point() or hidden.shape[0] > len(self.prompt_ids):
            raise ValueError("multimodal_hidden must be floating, one row per placeholder")
        if not isinstance(self.speech, SpeechOptions):
            raise ValueError(f"speech must be SpeechOptions; got {type(self.speech).__name__}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_ids": len(self.prompt_ids),
            "multimodal_hidden": list(self.multimodal_hidden.shape),
            "speech": self.speech.to_dict(),
        }


@dataclass(frozen=True)
class ThinkerTokens(Contract):
    """The thinker's answer as the talker hears it: ids as they are generated."""

    KEY: ClassVar[str] = "thinker_tokens"
    STAGES_ONLY: ClassVar[bool] = True  # the talker's; never the caller's

    token_ids: tuple[int, ...]
    done: bool = False  # the thinker has ended; no chunk follows

    def __post_init__(self) -> None:
        _check_ids("token_ids", self.token_ids)
        if not isinstance(self.done, bool):
            raise ValueError(f"done must be true or false; got {self.done!r}")
