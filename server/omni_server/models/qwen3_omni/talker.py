"""The talker (published: talker.*): an MoE decoder over codec frames that hears the thinker, and
its code predictor, a small dense decoder that completes every frame.

One talker step (`Talker.step_frame`), from the talker's logits for a frame's first code:
    code 0 = argmax of the talker's logits (after the reference's suppression and repetition
             penalty), or codec EOS: the speech ends
    codes 1 .. G-1 = the code predictor, run afresh on [the talker's last hidden state,
             embedding of code 0], one code each step, each through its own embedding table
             and head (`codec_embedding[g-1]`, `lm_head[g-1]`)
    next talker input = sum of the G codes' embeddings + the next text of the thinker
             (`trailing_text`, one a step; the tts pad embedding once it is spent)
The first frame's logits come from the prefill over the prompt `talker_prompt` builds
(talker_input.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from omni_server.models.qwen3_omni.config import DecoderShape, Qwen3OmniConfig
from omni_server.models.qwen3_omni.layers import KVCache, stack_experts
from omni_server.models.qwen3_omni.thinker import Decoder, prompt_positions
from omni_server.models.qwen3_omni.weights import CheckpointWeights, load_into


class Projection(nn.Module):
    """The thinker's width -> the talker's: linear, SiLU, linear (both with bias)."""

    def __init__(self, thinker_hidden: int, intermediate: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(thinker_hidden, intermediate)
        self.linear_fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class CodePredictor(nn.Module):
    """Dense Qwen3 decoder (QK-norm, plain rotary) with one input embedding and one head per
    residual code group (published: talker.code_predictor.*)."""

    def __init__(self, shape: DecoderShape, groups: int) -> None:
        super().__init__()
        self.shape = shape
        self.model = Decoder(shape)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(shape.vocab_size, shape.hidden_size) for _ in range(groups - 1)
        )
        self.lm_head = nn.ModuleList(
            nn.Linear(shape.hidden_size, shape.vocab_size, bias=False) for _ in range(groups - 1)
        )

    @torch.no_grad()
    def complete(self, talker_hidden: torch.Tensor, code0_embed: torch.Tensor) -> list[int]:
        """Greedy codes 1 .. G-1 of one frame from [talker hidden, code 0 embedding] [1, 1, h]
        each. A fresh KV cache of G positions a frame."""
        groups = len(self.lm_head) + 1
        kv = KVCache.for_decoder(self.shape, groups, like=talker_hidden)
        device = talker_hidden.device
        x = torch.cat((talker_hidden, code0_embed), dim=1)
        codes: list[int] = []
        for g in range(groups - 1):
            hidden, _ = self.model(x, torch.arange(kv.length, kv.length + x.shape[1]), kv)
            codes.append(int(torch.argmax(self.lm_head[g](hidden[0, -1]))))
            if g + 1 < groups - 1:
                x = self.codec_embedding[g](torch.tensor([[codes[-1]]], device=device))
        return codes


@dataclass
class TalkerState:
    """One speech's talker side: its KV cache, the thinker text still to be heard, the codes
    so far (for the repetition penalty), and the last step's outputs."""

    kv: KVCache
    trailing_text: torch.Tensor  # [1, n, talker hidden]: one entry a step, then tts_pad
    tts_pad: torch.Tensor  # [1, 1, talker hidden]
    logits: torch.Tensor  # [vocab]: the next frame's code-0 logits
    hidden: torch.Tensor  # [1, 1, hidden]: the talker's last normed hidden state
    step: int = 0
    first_codes: list[int] = field(default_factory=list)

    def hear(self, text: torch.Tensor) -> None:
        """Append projected thinker text [1, n, hidden] as the thinker streams it (then its
        tts_eos). The talker must not run ahead of it: a step past the text heard so far takes
        tts_pad, as after the end."""
        self.trailing_text = torch.cat((self.trailing_text, text.to(self.trailing_text)), dim=1)


class Talker(nn.Module):
    suppressed: torch.Tensor  # [vocab] bool: ids code 0 may never take

    def __init__(self, config: Qwen3OmniConfig) -> None:
        super().__init__()
        shape, ids = config.talker, config.talker_ids
        self.shape = shape
        self.ids = ids
        self.codec_embedding = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.model = Decoder(shape)
        self.codec_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        projection = (config.thinker_hidden_size, shape.intermediate_size, shape.hidden_size)
        self.text_projection = Projection(*projection)
        self.hidden_projection = Projection(*projection)
        self.code_predictor = CodePredictor(config.code_predictor, ids.num_code_groups)
        # the reference never lets the last 1024 ids win except codec EOS
        suppressed = torch.zeros(shape.vocab_size, dtype=torch.bool)
        suppressed[max(0, shape.vocab_size - 1024) :] = True
        suppressed[ids.codec_eos] = False
        self.register_buffer("suppressed", suppressed, persistent=False)

    @classmethod
    def from_checkpoint(
        cls, folder: Path | str, dtype: torch.dtype = torch.float32
    ) -> tuple[Talker, Qwen3OmniConfig]:
        config = Qwen3OmniConfig.from_folder(folder)
        model = cls(config)
        tensors = stack_experts(CheckpointWeights(folder).prefixed("talker.", dtype))
        tensors["codec_embedding.weight"] = tensors.pop("model.codec_embedding.weight")
        predictor = "code_predictor.model.codec_embedding."
        for name in [n for n in tensors if n.startswith(predictor)]:
            tensors["code_predictor.codec_embedding." + name[len(predictor) :]] = tensors.pop(name)
        load_into(model, tensors)
        return model.to(dtype).eval(), config

    @torch.no_grad()
    def prefill(
        self,
        prompt: torch.Tensor,  # [1, T, hidden]
        trailing_text: torch.Tensor,
        tts_pad: torch.Tensor,
        max_frames: int,
    ) -> TalkerState:
        kv = KVCache.for_decoder(self.shape, prompt.shape[1] + max_frames + 1, like=prompt)
        hidden, _ = self.model(prompt, prompt_positions(0, prompt.shape[1]), kv)
        last = hidden[:, -1:]
        return TalkerState(kv, trailing_text, tts_pad, self.codec_head(last)[0, 0], last)

    def choose_code0(
        self, state: TalkerState, repetition_penalty: float = 1.0, suppress_eos: bool = False
    ) -> int:
        """Greedy code 0 from the state's logits: repetition penalty on the codes so far
        (divide positive logits, multiply negative ones), then the suppressed ids out (codec
        EOS too with `suppress_eos`: the tests' long runs)."""
        logits = state.logits.clone()
        if repetition_penalty != 1.0 and state.first_codes:
            seen = torch.tensor(sorted(set(state.first_codes)), device=logits.device)
            picked = logits[seen]
            logits[seen] = torch.where(
                picked < 0, picked * repetition_penalty, picked / repetition_penalty
            )
        logits[self.suppressed] = -float("inf")
        if suppress_eos:
            logits[self.ids.codec_eos] = -float("inf")
        return int(torch.argmax(logits))

    @torch.no_grad()
    def step_frame(self, state: TalkerState, code0: int) -> list[int]:
        """Complete the frame whose code 0 was chosen, feed it (plus the next text) to the
        talker, and leave the next frame's logits in `state`. Returns the frame's G codes."""
        device = state.hidden.device
        code0_embed = self.codec_embedding(torch.tensor([[code0]], device=device))
        rest = self.code_predictor.complete(state.hidden, code0_embed)
        step_input = code0_embed.clone()
        for g, code in enumerate(rest):
            code_id = torch.tensor([[code]], device=device)
            step_input = step_input + self.code_predictor.codec_embedding[g](code_id)
        if state.step < state.trailing_text.shape[1]:
            step_input = step_input + state.trailing_text[:, state.step : state.step + 1]
        else:
            step_input = step_input + state.tts_pad
        state.step += 1
        state.first_codes.append(code0)
        hidden, _ = self.model(step_input, prompt_positions(state.kv.length, 1), state.kv)
        state.hidden = hidden[:, -1:]
        state.logits = self.codec_head(state.hidden)[0, 0]
        return [code0, *rest]

    def greedy_frames(
        self,
        state: TalkerState,
        max_frames: int,
        repetition_penalty: float = 1.0,
        suppress_eos: bool = False,
    ) -> torch.Tensor:
        """Frames [G, n] until codec EOS or `max_frames` codes 0 chosen (as the reference, the
        frame of the last chosen code 0 is completed only if another step follows)."""
        frames = []
        for chosen in range(1, max_frames + 1):
            code0 = self.choose_code0(state, repetition_penalty, suppress_eos)
            if code0 == self.ids.codec_eos or chosen == max_frames:
                break
            frames.append(self.step_frame(state, code0))
        return torch.tensor(frames, dtype=torch.long).T.reshape(self.ids.num_code_groups, -1)
