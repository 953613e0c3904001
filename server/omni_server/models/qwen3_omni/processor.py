"""Qwen3-Omni's processor for text and audio, without transformers: a conversation -> the
thinker's prompt ids and the audio tower's input, exactly as `Qwen3OmniMoeProcessor` with the
checkpoint's chat template builds them.

    messages   text parts and clips in the client's order; a clip is a content item
               {"type": "audio"}, which the template renders as
               <|audio_start|><|audio_pad|><|audio_end|>
    ids        the rendered text tokenized (no special tokens added: the template writes its
               own), each clip's one <|audio_pad|> then repeated once per embedding the tower
               gives for it (audio_encoder.output_lengths of its mel frames), clip by clip
    features   each clip decoded (PyAV), mixed to mono, resampled to 16 kHz (soxr), its log-mel
               (mel.py): [mel bins, frames], the clips' frames one after another

Images and videos are not served: a prompt holding their placeholder tokens is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from omni_server.audio import decode, resample
from omni_server.audio.decode import TooLong
from omni_server.contracts import AudioPart, Message
from omni_server.models.qwen3_omni.audio_encoder import output_lengths
from omni_server.models.qwen3_omni.config import Qwen3OmniConfig
from omni_server.models.qwen3_omni.mel import N_FFT, SAMPLE_RATE, log_mel


class ChatTokenizer(Protocol):
    """The checkpoint's tokenizer as the processor uses it (the engine's HFTokenizer)."""

    max_token_chars: int

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...

    def encode(self, text: str) -> list[int]: ...


class PromptError(ValueError):
    """The request cannot become a prompt; `param` names the part at fault."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    features: torch.Tensor | None  # [mel bins, sum(frames)] float32; None without audio
    frames: tuple[int, ...]  # each clip's mel frames, in prompt order

    @property
    def placeholders(self) -> int:
        return int(output_lengths(torch.tensor(self.frames)).sum()) if self.frames else 0


def template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The conversation as the chat template reads it: a text turn's content as a string, a
    turn with clips as its parts in order (clips as {"type": "audio"})."""
    out: list[dict[str, Any]] = []
    for message in messages:
        content: Any = message.content
        if isinstance(content, tuple):
            content = [
                {"type": "audio", "audio": f"clip{i}"}
                if isinstance(part, AudioPart)
                else {"type": "text", "text": part}
                for i, part in enumerate(content)
            ]
        out.append({"role": message.role, "content": content})
    return out


class Processor:
    """One checkpoint's prompt builder (its tokenizer, chat template and token ids)."""

    def __init__(
        self, tokenizer: ChatTokenizer, config: Qwen3OmniConfig, max_clip_seconds: float
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.max_clip_seconds = max_clip_seconds
        self.refused_ids = {config.image_token_id, config.video_token_id}

    def prompt(self, messages: Sequence[Message], max_tokens: int) -> Prompt:
        """The thinker's prompt; PromptError for a clip that is no audio, a prompt over
        `max_tokens` (context_length_exceeded) or image / video placeholders."""
        clips = [
            (f"messages[{i}].content[{j}]", part)
            for i, message in enumerate(messages)
            if isinstance(message.content, tuple)
            for j, part in enumerate(message.content)
            if isinstance(part, AudioPart)
        ]
        text = self.tokenizer.apply_chat_template(template_messages(messages))
        # bounded before tokenizing: a prompt too long whatever its tokens is refused first
        if len(text) > max_tokens * self.tokenizer.max_token_chars:
            raise PromptError(
                f"the prompt has {len(text)} characters: more than {max_tokens} tokens of "
                "this model's context can hold",
                "messages",
                "context_length_exceeded",
            )
        ids = self.tokenizer.encode(text)
        audio = self.config.audio_token_id
        slots = [i for i, token in enumerate(ids) if token == audio]
        if len(slots) != len(clips):
            raise PromptError(
                f"the prompt holds {len(slots)} audio placeholders for {len(clips)} clips (the "
                "text must not write the audio placeholder token itself)",
                "messages",
            )
        if any(token in self.refused_ids for token in ids):
            raise PromptError("images and videos are not served by this model", "messages")
        mels = [self.features(param, part) for param, part in clips]
        frames = tuple(m.shape[1] for m in mels)
        counts = output_lengths(torch.tensor(frames), self.config.audio.n_window).tolist()
        expanded: list[int] = []
        start = 0
        for slot, count in zip(slots, counts, strict=True):
            expanded += ids[start:slot] + [audio] * int(count)
            start = slot + 1
        expanded += ids[start:]
        if len(expanded) > max_tokens:
            raise PromptError(
                f"the prompt is {len(expanded)} tokens (its audio {sum(counts)}); this "
                f"model's context holds {max_tokens}",
                "messages",
                "context_length_exceeded",
            )
        features = torch.cat(mels, dim=1) if mels else None
        return Prompt(tuple(expanded), features, frames)

    def features(self, param: str, part: AudioPart) -> torch.Tensor:
        """A clip's log-mel features [bins, frames]; PromptError naming `param` when it is no
        audio of its format, empty, too short for one frame or too long."""
        try:
            samples, rate = decode(part.data, part.format, max_seconds=self.max_clip_seconds)
        except TooLong as err:
            raise PromptError(f"{param}: {err}", param) from err
        except ValueError as err:
            raise PromptError(f"{param}: not a {part.format} clip ({err})", param) from err
        if rate != SAMPLE_RATE:
            samples = resample(samples, rate, SAMPLE_RATE)
        if len(samples) < N_FFT // 2 + 1:
            raise PromptError(
                f"{param}: {len(samples) / SAMPLE_RATE:.3f} s of audio is too short to hear "
                f"(at least {(N_FFT // 2 + 1) / SAMPLE_RATE * 1000:.0f} ms)",
                param,
            )
        return log_mel(samples, self.config.audio.num_mel_bins)
