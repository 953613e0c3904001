"""STAND-IN (tests only, labelled): the thinker side of the typed thinker -> talker edge
(models/qwen3_omni/handoff.py), computed by the plain-torch `Thinker` (models/qwen3_omni/
thinker.py, checked against transformers in tests/models/qwen3_omni) on the repository's
checkpoint: greedy tokens, layer `accept_hidden_layer`'s output at the multimodal placeholders.

In: {"prompt_ids": [ids of a chat-templated text prompt], "speech": SpeechOptions,
"max_tokens": n (optional)}, or the speech endpoint's {"text", "speech"} (the text as the user's
turn of a ChatML prompt, tokenized by the checkpoint's tokenizer.json). Out (to the talker):
the TalkerOpening with the first token, then one ThinkerTokens chunk per generated token, the
last done=True. The whole run is computed first (the talker then still meets its text one
token a chunk, and waits for late ones)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from omni_server.backend import Request, StageBackend, StageContext
from omni_server.contracts import SpeechOptions
from omni_server.models.qwen3_omni.handoff import TalkerOpening, ThinkerTokens
from omni_server.models.qwen3_omni.thinker import Thinker, greedy_run


class StandInThinker(StageBackend):
    def initialize(self, context: StageContext) -> None:
        torch.set_num_threads(1)
        folder = Path(context.repository_parameters["checkpoint"])
        self.thinker, self.config = Thinker.from_checkpoint(folder)
        self.max_tokens = int(context.parameters.get("max_tokens", 12))
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))

    def generate(self, request: Request) -> Iterator[dict[str, Any]]:
        inputs = request.inputs
        ids = inputs.get("prompt_ids")
        if ids is None:
            chat = f"<|im_start|>user\n{inputs['text']}<|im_end|>\n<|im_start|>assistant\n"
            ids = self.tokenizer.encode(chat).ids
        yield from thinker_chunks(
            self.thinker, self.config, list(ids), SpeechOptions.of(inputs),
            int(inputs.get("max_tokens", self.max_tokens)),
        )  # fmt: skip


def thinker_chunks(
    thinker: Thinker, config: Any, prompt_ids: list[int], speech: SpeechOptions, max_tokens: int
) -> list[dict[str, Any]]:
    """The chunks the talker hears for one text prompt (greedy, ending at <|im_end|>)."""
    ids = torch.tensor([prompt_ids])
    layer = config.talker_ids.accept_hidden_layer
    run = greedy_run(thinker, thinker.embed(ids), max_tokens,
                     stop_ids=(config.im_end_token_id,), capture_layer=layer)  # fmt: skip
    assert run.captured is not None
    placeholders = {config.audio_token_id, config.image_token_id, config.video_token_id}
    rows = [i for i, t in enumerate(prompt_ids) if t in placeholders]
    opening = TalkerOpening(tuple(prompt_ids), run.captured[0, rows].clone(), speech)
    last = len(run.tokens) - 1
    chunks: list[dict[str, Any]] = [
        {"thinker_tokens": ThinkerTokens((token,), done=n == last)}
        for n, token in enumerate(run.tokens)
    ]
    chunks[0][TalkerOpening.KEY] = opening
    return chunks
