"""The thinker's text decoder: Qwen3 MoE (QK-norm attention, top-k experts, the multimodal
interleaved rotary) with its LM head, read from `thinker.model.*` and `thinker.lm_head.weight`.

Shaped for a step loop: `forward(embeds, positions, kv)` runs T new positions of a batch over the
KV cache and returns the normed hidden states (plus, on request, one layer's output: the talker
hears layer `accept_hidden_layer`). `greedy_generate` is the minimal loop the tests compare with
transformers; an engine family replaces it with its own scheduler.

Positions: for a prompt of text and audio (no image or video grid) the reference gives every
token the same position on the three rotary axes, counting up from 0
(`get_rope_index`'s sequential branch), and decoding continues from there (`prompt_positions`).
Image and video grids (3-D positions) are not implemented here yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from omni_server.models.qwen3_omni.config import DecoderShape, Qwen3OmniConfig
from omni_server.models.qwen3_omni.layers import (
    DecoderLayer,
    KVCache,
    RMSNorm,
    attention_mask,
    inverse_frequencies,
    rotary_cos_sin,
    stack_experts,
)
from omni_server.models.qwen3_omni.weights import CheckpointWeights, load_into


def prompt_positions(start: int, count: int) -> torch.Tensor:
    """[3, count]: positions start..start+count-1 on the temporal, height and width axes (text
    and audio tokens)."""
    return torch.arange(start, start + count).expand(3, -1)


class Decoder(nn.Module):
    """A Qwen3 (MoE) decoder stack over embeddings: the thinker's and the talker's body."""

    inv_freq: torch.Tensor

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.shape = shape
        self.layers = nn.ModuleList(DecoderLayer(shape, i) for i in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.register_buffer(
            "inv_freq", inverse_frequencies(shape.head_dim, shape.rope_theta), persistent=False
        )

    def forward(
        self,
        embeds: torch.Tensor,  # [B, T, hidden]
        positions: torch.Tensor,  # [3, T] (or [T] for plain rotary)
        kv: KVCache | None = None,
        capture_layer: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final normed hidden [B, T, hidden], the input to layer `capture_layer` (0: the
        embeddings; L: the last layer's output before the norm) or None). Writes the T
        positions into `kv` and advances it."""
        past = kv.length if kv is not None else 0
        cos, sin = rotary_cos_sin(positions, self.inv_freq, self.shape.mrope_section)
        mask = attention_mask(past, embeds.shape[1], device=embeds.device)
        x, captured = embeds, None
        for i, layer in enumerate(self.layers):
            if i == capture_layer:
                captured = x
            x = layer(x, cos, sin, mask, kv)
        if capture_layer == len(self.layers):
            captured = x
        if kv is not None:
            kv.advance(embeds.shape[1])
        return self.norm(x), captured


class Thinker(nn.Module):
    """Token embeddings + decoder + LM head (published: thinker.model.*, thinker.lm_head)."""

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.model = Decoder(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)

    @classmethod
    def from_checkpoint(
        cls, folder: Path | str, dtype: torch.dtype = torch.float32
    ) -> tuple[Thinker, Qwen3OmniConfig]:
        config = Qwen3OmniConfig.from_folder(folder)
        model = cls(config.thinker)
        weights = CheckpointWeights(folder)
        body = stack_experts(weights.prefixed("thinker.model.", dtype))
        tensors = {
            "embed_tokens.weight": body.pop("embed_tokens.weight"),
            "lm_head.weight": weights.prefixed("thinker.lm_head.", dtype)["weight"],
            **{f"model.{k}": v for k, v in body.items()},
        }
        load_into(model, tensors)
        return model.to(dtype).eval(), config

    def embed(
        self,
        ids: torch.Tensor,  # [B, T]
        audio_token_id: int | None = None,
        audio_features: torch.Tensor | None = None,  # [n_audio_tokens, hidden]
    ) -> torch.Tensor:
        """Token embeddings, with the audio encoder's outputs in place of the audio
        placeholder tokens (in order; their count must match)."""
        embeds = self.embed_tokens(ids)
        if audio_features is not None:
            if audio_token_id is None:
                raise ValueError("audio features given without the audio placeholder token id")
            slots = ids == audio_token_id
            if int(slots.sum()) != audio_features.shape[0]:
                raise ValueError(
                    f"{int(slots.sum())} audio placeholder tokens, "
                    f"{audio_features.shape[0]} audio features"
                )
            embeds = embeds.clone()
            embeds[slots] = audio_features.to(embeds.dtype)
        return embeds

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        kv: KVCache | None = None,
        capture_layer: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(logits [B, T, vocab], normed hidden, captured layer input) for T new positions."""
        hidden, captured = self.model(embeds, positions, kv, capture_layer)
        return self.lm_head(hidden), hidden, captured


@torch.no_grad()
def greedy_generate(
    thinker: Thinker,
    prompt_embeds: torch.Tensor,  # [1, T, hidden]
    max_new_tokens: int,
    stop_ids: tuple[int, ...] = (),
    suppress_ids: tuple[int, ...] = (),
) -> list[int]:
    """Greedy tokens after the prompt, one KV-cached step each, until a stop id (included) or
    `max_new_tokens`. `suppress_ids` never win (the tests keep EOS out of long runs)."""
    return greedy_run(thinker, prompt_embeds, max_new_tokens, stop_ids, suppress_ids).tokens


@dataclass
class ThinkerRun:
    tokens: list[int]  # generated
    embeds: torch.Tensor  # [1, T + n - 1, hidden]: the input of every position run
    captured: torch.Tensor | None  # [1, T + n - 1, hidden]: layer `capture_layer`'s input


@torch.no_grad()
def greedy_run(
    thinker: Thinker,
    prompt_embeds: torch.Tensor,
    max_new_tokens: int,
    stop_ids: tuple[int, ...] = (),
    suppress_ids: tuple[int, ...] = (),
    capture_layer: int | None = None,
) -> ThinkerRun:
    """`greedy_generate`, keeping what the talker hears: every position's input embedding and
    the input of layer `capture_layer` (the last generated token is never run)."""
    prompt_len = prompt_embeds.shape[1]
    kv = KVCache.for_decoder(thinker.shape, prompt_len + max_new_tokens, like=prompt_embeds)
    embeds = [prompt_embeds]
    logits, _, captured = thinker(prompt_embeds, prompt_positions(0, prompt_len), kv, capture_layer)
    taps = [captured]
    tokens: list[int] = []
    while True:
        last = logits[0, -1].clone()
        if suppress_ids:
            last[list(suppress_ids)] = -float("inf")
        token = int(torch.argmax(last))
        tokens.append(token)
        if token in stop_ids or len(tokens) == max_new_tokens:
            break
        step = thinker.embed_tokens(torch.tensor([[token]], device=prompt_embeds.device))
        embeds.append(step)
        logits, _, captured = thinker(step, prompt_positions(kv.length, 1), kv, capture_layer)
        taps.append(captured)
    hidden = None if capture_layer is None else torch.cat([t for t in taps if t is not None], 1)
    return ThinkerRun(tokens, torch.cat(embeds, dim=1), hidden)
