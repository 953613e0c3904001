"""Higgs Audio v2's decoder: a Llama whose layers have a second FFN for audio positions
("DualFFN") and whose head predicts one frame of K codebooks instead of a text token.

Per position, as transformers' `HiggsAudioV2Model`: a text position embeds its token and runs the
text norms + MLP; an audio position (a frame token in the text track, frames.py) embeds the
sum of its K code embeddings (`embed_audio[code + k * C]`) and runs the audio norms + MLP.
Attention (and the KV cache) is shared. The head is `audio_lm_head` alone: [K * C] logits a
position (the training-only text head is not loaded).

Which rows are audio comes in the ForwardBatch's `family_inputs` (`FrameInputs`, built by the
family's head, head.py): None means every row is text, `audio_rows` None with codes means every
row is audio (a decode step: every generated position is a frame, so a decode graph runs the
audio path alone, no index work), both set means mixed (a prefill chunk with reference audio, or
a recompute after preemption).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from omni_server.engine.attention import ForwardBatch
from omni_server.engine.config import LlamaShape
from omni_server.engine.families.higgs_audio_v2.frames import AudioSpec
from omni_server.engine.families.higgs_audio_v2.head import FrameHead, frame_inputs
from omni_server.engine.families.llama.model import MLP, DecoderLayer, Llama, RMSNorm
from omni_server.engine.parallel import SINGLE, TensorParallel


class DualFFNLayer(DecoderLayer):
    def __init__(self, shape: LlamaShape, tp: TensorParallel = SINGLE) -> None:
        super().__init__(shape, tp)
        self.audio_attn_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.audio_ffn_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.audio_mlp = MLP(shape, tp)

    def forward(
        self,
        h: torch.Tensor,  # [T, C]
        rope: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        frames = frame_inputs(batch)
        if frames is None:  # text only
            return super().forward(h, rope, k_cache, v_cache, batch)
        rows = frames.audio_rows
        if rows is None:  # audio only
            h = h + self.attn(self.audio_attn_norm(h), rope, k_cache, v_cache, batch)
            return h + self.audio_mlp(self.audio_ffn_norm(h))
        text = frames.text_rows
        assert text is not None, "a mixed batch names its text rows too"
        x = self.attn_norm(h).index_copy(0, rows, self.audio_attn_norm(h.index_select(0, rows)))
        h = h + self.attn(x, rope, k_cache, v_cache, batch)
        out = torch.empty_like(h)
        out.index_copy_(0, text, self.mlp(self.ffn_norm(h.index_select(0, text))))
        out.index_copy_(0, rows, self.audio_mlp(self.audio_ffn_norm(h.index_select(0, rows))))
        return h + out

    def forward_deferred(
        self,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        rope: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """DecoderLayer.forward_deferred with the audio norms and MLP on an audio-only batch
        (a decode step); a mixed batch adds `delta` and runs forward() (prefill only)."""
        frames = frame_inputs(batch)
        if frames is None:
            return super().forward_deferred(h, delta, rope, k_cache, v_cache, batch)
        if frames.audio_rows is None:
            h, x = self.audio_attn_norm.after_add(delta, h)
            h, x = self.audio_ffn_norm.after_add(self.attn(x, rope, k_cache, v_cache, batch), h)
            return h, self.audio_mlp(x)
        if delta is not None:
            h = h + delta
        return self.forward(h, rope, k_cache, v_cache, batch), None


class HiggsAudioV2(Llama):
    layer_class = DualFFNLayer
    text_head = False  # transformers' text_lm_head is training-only

    def __init__(
        self,
        shape: LlamaShape,
        audio: AudioSpec,
        max_positions: int,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__(shape, max_positions, tp)
        self.audio = audio
        self.head = FrameHead(audio)  # a frame of K codes a step (head.py)
        k, c = audio.num_codebooks, audio.codebook_size
        self.embed_audio = nn.Embedding(k * c, shape.hidden_size)  # codebook k at rows k*C..
        self.audio_head = nn.Linear(shape.hidden_size, k * c, bias=False)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(
        self,
        batch: ForwardBatch,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor:  # [R, K * C] float32 frame logits of batch.logits_indices
        h = self.embed(batch.input_ids)  # [T, C]
        inputs = frame_inputs(batch)
        if inputs is not None:
            k, c = self.audio.num_codebooks, self.audio.codebook_size
            offsets = torch.arange(0, k * c, c, device=inputs.audio_codes.device)  # [K]
            frames = self.embed_audio(inputs.audio_codes + offsets).sum(dim=1)  # [A, C]
            rows = inputs.audio_rows
            h = frames if rows is None else h.index_copy(0, rows, frames)
        rope = self.rope_rows(batch.positions)  # [T, 1, D/2]
        h = self.final_hidden(h, rope, batch, k_caches, v_caches)  # [R, C]
        return F.linear(h, self.audio_head.weight).float()

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Llama's engine names (without lm_head) plus embed_audio, audio_head and per layer
        audio_attn_norm / audio_ffn_norm / audio_w_gate / audio_w_up / audio_w_down."""
        super().load_weights(weights)
        put = self.weight_copier()

        with torch.no_grad():
            put("embed_audio.weight", weights["embed_audio"])
            put("audio_head.weight", weights["audio_head"])
            for i in range(self.shape.num_layers):
                w = f"layers.{i}."
                put(w + "audio_attn_norm.weight", weights[w + "audio_attn_norm"])
                put(w + "audio_ffn_norm.weight", weights[w + "audio_ffn_norm"])
                gate_up = torch.cat([weights[w + "audio_w_gate"], weights[w + "audio_w_up"]])
                put(w + "audio_mlp.w_gate_up.weight", gate_up)
                put(w + "audio_mlp.w_down.weight", weights[w + "audio_w_down"])
