"""Preprocessing: a chat request -> the thinker's prompt ids and the audio tower's input, as
transformers' Qwen3-Omni processor and the checkpoint's chat template build them
(models/qwen3_omni/processor.py): text parts and clips in the client's order, each clip
decoded, mixed to mono, resampled to 16 kHz, its log-mel features, its placeholder repeated
once per embedding the tower will give.

In: {"chat": ChatInput}. Out: {"chat", "prompt_ids" (tuple of ints), "features" ([mel bins,
frames] float32, None without audio), "frames" (each clip's mel frames)} to the audio encoder.
A clip that is no audio of its format, too short or too long, a prompt over the context: a 400
naming the part (`messages[i].content[j]`) or `messages`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omni_server.backend import InvalidRequest, StageBackend, StageConfigError, StageContext
from omni_server.contracts import ChatInput
from omni_server.engine import ChatTemplateError, CheckpointError, HFTokenizer
from omni_server.models.qwen3_omni.config import Qwen3OmniConfig
from omni_server.models.qwen3_omni.folder import CheckpointFolderError, checkpoint_folder
from omni_server.models.qwen3_omni.processor import Processor, PromptError


class Preprocessing(StageBackend):
    def initialize(self, context: StageContext) -> None:
        try:
            folder = checkpoint_folder(context.repository_parameters)
            tokenizer = HFTokenizer(folder)
            config = Qwen3OmniConfig.from_folder(folder)
        except (CheckpointFolderError, CheckpointError, KeyError, ValueError) as err:
            raise StageConfigError(str(err)) from err
        seconds = context.parameters.get("max_clip_seconds", 300.0)
        if not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds <= 0:
            raise StageConfigError(f"parameters.max_clip_seconds must be > 0; found {seconds!r}")
        context_tokens = context.parameters.get("max_prompt_tokens")
        if context_tokens is None:
            context_tokens = _max_positions(folder)
        if not isinstance(context_tokens, int) or context_tokens < 1:
            raise StageConfigError(
                f"parameters.max_prompt_tokens must be a positive integer; found {context_tokens!r}"
            )
        # the thinker refuses what its KV budget cannot hold; this bound keeps a prompt that no
        # context could hold from being decoded and encoded first
        self.max_prompt_tokens = context_tokens
        self.processor = Processor(tokenizer, config, float(seconds))

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._one(request.inputs) for request in requests]

    def _one(self, inputs: dict[str, Any]) -> dict[str, Any] | InvalidRequest:
        chat = ChatInput.of(inputs)
        try:
            prompt = self.processor.prompt(chat.messages, self.max_prompt_tokens)
        except PromptError as err:
            return InvalidRequest(str(err), code=err.code, param=err.param)
        except ChatTemplateError as err:  # e.g. roles the model's template refuses
            return InvalidRequest(str(err), param="messages")
        return {
            ChatInput.KEY: chat,
            "prompt_ids": prompt.ids,
            "features": prompt.features,
            "frames": prompt.frames,
        }


def _max_positions(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    text = config["thinker_config"]["text_config"]
    return int(text.get("max_position_embeddings") or 32768)
