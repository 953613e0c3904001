"""What crosses the thinker -> talker edge: the talker's prompt, the thinker text it hears one
step at a time, and the tts pad it hears after that, built from the thinker's inputs and outputs
as the reference's `generate` builds them (one conversation, no padding).

    user turn(s): every token of a user turn, projected: audio / image / video placeholders
        through `hidden_projection` of the thinker's layer `accept_hidden_layer` output there,
        text through `text_projection` of the thinker's input embedding
    assistant turn (9 positions): text side  = <|im_start|> assistant \\n, 4 x tts_pad,
        tts_bos, the first generated token; codec side (added) = 0, 0, 0, no-think,
        think-bos, think-eos, the speaker, codec pad, codec bos
    trailing text: the generated tokens from the second on (as fed back to the thinker, so the
        last generated token is not among them), then tts_eos
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from omni_server.models.qwen3_omni.config import Qwen3OmniConfig
from omni_server.models.qwen3_omni.talker import Talker
from omni_server.models.qwen3_omni.thinker import Thinker


@dataclass
class TalkerPrompt:
    prompt: torch.Tensor  # [1, T, talker hidden]
    trailing_text: torch.Tensor  # [1, n, talker hidden]
    tts_pad: torch.Tensor  # [1, 1, talker hidden]
    tts_eos: torch.Tensor  # [1, 1, talker hidden]: heard after the last text


def project_text(thinker: Thinker, talker: Talker, token_ids: list[int]) -> torch.Tensor:
    """Generated thinker tokens as the talker hears them: [1, n, talker hidden] (stream them
    into `TalkerState.hear` as the thinker produces them)."""
    ids = torch.tensor([token_ids], device=thinker.embed_tokens.weight.device)
    return talker.text_projection(thinker.embed_tokens(ids))


@torch.no_grad()
def talker_prompt(
    config: Qwen3OmniConfig,
    thinker: Thinker,
    talker: Talker,
    prompt_ids: torch.Tensor,  # [1, S]
    generated: list[int],  # N tokens (the last one, usually EOS, is never fed back)
    thinker_embeds: torch.Tensor,  # [1, S + N - 1, thinker hidden]: inputs of every position
    thinker_hidden: torch.Tensor,  # [1, S + N - 1, thinker hidden]: layer accept_hidden_layer
    speaker: str,
    text_done: bool = True,
) -> TalkerPrompt:
    """`text_done` False: the thinker is still generating (at least its first token is in
    `thinker_embeds`); the trailing text holds what was generated so far without tts_eos, and
    the rest is streamed in with `project_text` + `TalkerState.hear`, tts_eos last."""
    ids = config.talker_ids
    speaker_id = ids.speakers.get(speaker.lower())
    if speaker_id is None:
        raise ValueError(f"unknown speaker {speaker!r}; this checkpoint has {sorted(ids.speakers)}")
    s = prompt_ids.shape[1]
    tokens = prompt_ids[0].tolist()
    placeholders = {config.audio_token_id, config.image_token_id, config.video_token_id}

    # the user turns: each prompt position's role is the token after the latest <|im_start|>
    user_positions, role = [], None
    for i, token in enumerate(tokens):
        if token == config.im_start_token_id and i + 1 < s:
            role = tokens[i + 1]
        if role == config.user_token_id:
            user_positions.append(i)
    # projected over the whole prompt (as the reference batches it), then the user positions
    prompt_embeds = thinker_embeds[:, :s]
    multimodal = torch.tensor([t in placeholders for t in tokens], device=prompt_embeds.device)
    projected = prompt_embeds.new_empty(1, s, talker.shape.hidden_size)
    projected[:, ~multimodal] = talker.text_projection(prompt_embeds[:, ~multimodal])
    if bool(multimodal.any()):
        projected[:, multimodal] = talker.hidden_projection(thinker_hidden[:, :s][:, multimodal])
    user = projected[:, user_positions]

    starts = [
        i
        for i in range(s - 1)
        if tokens[i] == config.im_start_token_id and tokens[i + 1] == config.assistant_token_id
    ]
    if not starts:
        raise ValueError("the prompt has no assistant turn (<|im_start|>assistant)")
    assistant = talker.text_projection(thinker_embeds[:, starts[-1] : s + len(generated)])
    device = thinker_embeds.device
    specials = [config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]
    projected = talker.text_projection(
        thinker.embed_tokens(torch.tensor([specials], device=device))
    )
    tts_bos, tts_eos, tts_pad = projected.chunk(3, 1)
    text_side = torch.cat(
        (assistant[:, :3], tts_pad.expand(1, 4, -1), tts_bos, assistant[:, 3:4]), 1
    )
    codec_ids = [ids.codec_nothink, ids.codec_think_bos, ids.codec_think_eos, speaker_id,
                 ids.codec_pad, ids.codec_bos]  # fmt: skip
    codec_embeds = talker.codec_embedding(torch.tensor([codec_ids], device=device))
    codec_side = torch.cat((text_side.new_zeros(1, 3, text_side.shape[-1]), codec_embeds), 1)
    prompt = torch.cat((user, text_side + codec_side), dim=1)
    trailing = torch.cat((assistant[:, 4:], tts_eos), dim=1) if text_done else assistant[:, 4:]
    return TalkerPrompt(prompt, trailing, tts_pad, tts_eos)


# ---- from the typed edge (handoff.py): what the talker stage builds as the thinker streams ----


class _Width(Protocol):
    @property
    def hidden_size(self) -> int: ...


class TalkerParts(Protocol):
    """What the talker's input is built with: the plain-torch `Talker`, or the engine's
    (engine/families/qwen3_omni_talker/model.py)."""

    @property
    def shape(self) -> _Width: ...

    @property
    def codec_embedding(self) -> nn.Module: ...

    @property
    def text_projection(self) -> nn.Module: ...

    @property
    def hidden_projection(self) -> nn.Module: ...


def speaker_id(config: Qwen3OmniConfig, voice: str) -> int:
    """The codec id of a speaker (case-insensitive); ValueError naming the speakers else."""
    found = config.talker_ids.speakers.get(voice.lower())
    if found is None:
        speakers = ", ".join(sorted(config.talker_ids.speakers))
        raise ValueError(f"unknown voice {voice!r}; this checkpoint's speakers are: {speakers}")
    return found


@torch.no_grad()
def tts_specials(
    config: Qwen3OmniConfig, embed_tokens: nn.Embedding, talker: TalkerParts
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tts_bos, tts_eos, tts_pad) as the talker hears them, [1, 1, talker hidden] each."""
    specials = [config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]
    ids = torch.tensor([specials], device=embed_tokens.weight.device)
    bos, eos, pad = talker.text_projection(embed_tokens(ids)).chunk(3, 1)
    return bos, eos, pad


@torch.no_grad()
def opening_prompt(
    config: Qwen3OmniConfig,
    embed_tokens: nn.Embedding,  # the thinker's input embedding table (only it)
    talker: TalkerParts,
    prompt_ids: list[int],
    multimodal_hidden: torch.Tensor,  # [M, thinker hidden]: layer accept_hidden_layer there
    first_token: int,  # the thinker's first generated id
    speaker: int,  # codec id (speaker_id)
) -> torch.Tensor:
    """The talker's prompt [1, T, talker hidden] from what the thinker sends first (a
    TalkerOpening and its first generated id), equal to `talker_prompt`'s: the same projections
    over the same rows (the user turns' text projected over the whole prompt at once, the
    multimodal rows through hidden_projection; the assistant's 4 text rows together)."""
    s = len(prompt_ids)
    device = embed_tokens.weight.device
    placeholders = {config.audio_token_id, config.image_token_id, config.video_token_id}
    multimodal = torch.tensor([t in placeholders for t in prompt_ids], device=device)
    if int(multimodal.sum()) != multimodal_hidden.shape[0]:
        raise ValueError(
            f"{int(multimodal.sum())} multimodal placeholders in the prompt, "
            f"{multimodal_hidden.shape[0]} rows of multimodal_hidden"
        )
    user_positions, role = [], None
    for i, token in enumerate(prompt_ids):
        if token == config.im_start_token_id and i + 1 < s:
            role = prompt_ids[i + 1]
        if role == config.user_token_id:
            user_positions.append(i)
    prompt_embeds = embed_tokens(torch.tensor([prompt_ids], device=device))
    projected = prompt_embeds.new_empty(1, s, talker.shape.hidden_size)
    projected[:, ~multimodal] = talker.text_projection(prompt_embeds[:, ~multimodal])
    if bool(multimodal.any()):
        hidden = multimodal_hidden.to(device=device, dtype=prompt_embeds.dtype)
        projected[:, multimodal] = talker.hidden_projection(hidden[None])
    user = projected[:, user_positions]
    starts = [
        i
        for i in range(s - 1)
        if prompt_ids[i] == config.im_start_token_id
        and prompt_ids[i + 1] == config.assistant_token_id
    ]
    if not starts or starts[-1] + 3 != s:
        raise ValueError("the prompt must end with the assistant turn's <|im_start|>assistant\\n")
    head = torch.tensor([[*prompt_ids[starts[-1] :], first_token]], device=device)
    assistant = talker.text_projection(embed_tokens(head))  # [1, 4, talker hidden]
    tts_bos, _, tts_pad = tts_specials(config, embed_tokens, talker)
    text_side = torch.cat(
        (assistant[:, :3], tts_pad.expand(1, 4, -1), tts_bos, assistant[:, 3:]), 1
    )
    ids = config.talker_ids
    codec_ids = [ids.codec_nothink, ids.codec_think_bos, ids.codec_think_eos, speaker,
                 ids.codec_pad, ids.codec_bos]  # fmt: skip
    codec_embeds = talker.codec_embedding(torch.tensor([codec_ids], device=device))
    codec_side = torch.cat((text_side.new_zeros(1, 3, text_side.shape[-1]), codec_embeds), 1)
    return torch.cat((user, text_side + codec_side), dim=1)
