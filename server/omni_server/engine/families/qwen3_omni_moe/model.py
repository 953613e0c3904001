"""Qwen3-Omni's thinker decoder on the engine: the llama family's `Llama` with QK-norm in its
attention and the top-k routed experts (models/qwen3_omni/layers.py's `SparseMoE`) as the MLP
of its sparse layers.

Rotary: the thinker's is multimodal (three position axes interleaved over the frequencies);
a text token carries the same position on all three axes, which makes it the plain rotary the
engine's RoPE table holds (models/qwen3_omni/layers.py, `rotary_cos_sin`). So does an audio
placeholder: transformers' `get_rope_index` gives a clip's placeholders consecutive positions,
the same on all three axes, and the text after it carries on from there (images and videos,
which would not, are not served), so the engine's sequential positions are exact for text and
audio prompts.

Audio in: the prompt rows a request gives embeddings for (the audio tower's output at its
placeholders) take them in place of the token's (prompt_rows.py, the family's head), and the
output of layer `tap_layer - 1` (transformers' `hidden_states[accept_hidden_layer]`, what the
talker hears) is kept at those rows when the request asks for it.

Q / K rows (and the q_norm / k_norm weights, which scale each head dimension) are loaded in
pair order, as the llama family does: RMSNorm over a head is unchanged by a permutation of
its dimensions when its weight is permuted alike.

Tensor parallelism is not supported (the experts are not sharded): one rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
from torch import nn

from omni_server.engine.attention import ForwardBatch, paged_attention
from omni_server.engine.config import LlamaShape
from omni_server.engine.families.llama.model import (
    MLP,
    Attention,
    DecoderLayer,
    Llama,
    RMSNorm,
    sampled_rows,
)
from omni_server.engine.families.qwen3_omni_moe.prompt_rows import PromptRows, PromptRowsHead
from omni_server.engine.parallel import SINGLE, TensorParallel
from omni_server.models.qwen3_omni.config import DecoderShape
from omni_server.models.qwen3_omni.layers import SparseMoE, fused_experts_for


class QKNormAttention(Attention):
    """The engine's paged attention with RMSNorm on each query and key head before RoPE."""

    def __init__(self, shape: LlamaShape, tp: TensorParallel = SINGLE) -> None:
        super().__init__(shape, tp)
        self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)
        self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [T, C]
        rope: torch.Tensor,  # [T, 1, D/2] complex64
        k_cache: torch.Tensor,  # [S, Hkv, D]
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, C]
        t, kernels, d = x.shape[0], self.kernels, self.head_dim
        q, k, v = kernels.linear(x, self.wqkv.weight).split(self.split, dim=-1)
        q = self.q_norm(q.reshape(-1, d)).view(t, -1)
        k = self.k_norm(k.reshape(-1, d)).view(t, -1)
        qkv = torch.cat([q, k, v], dim=-1)  # normed heads, then RoPE and the cache write
        q = kernels.rope_and_cache(qkv, rope, batch.slot_mapping, k_cache, v_cache, self.num_heads)
        out = paged_attention(q, k_cache, v_cache, batch)  # [T, H, D]
        return kernels.project(out.view(t, -1), self.wo.weight, self.tp, residual)


class RoutedMLP(MLP):
    """The llama MLP's call (x, residual) over the thinker's routed experts."""

    def __init__(self, moe: DecoderShape) -> None:
        nn.Module.__init__(self)  # no dense weights: the experts replace them
        self.moe = SparseMoE(moe)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        out = self.moe(x)
        return out if residual is None else out + residual


class ThinkerLayer(DecoderLayer):
    def __init__(self, shape: LlamaShape, moe: DecoderShape, index: int) -> None:
        nn.Module.__init__(self)
        self.attn_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.attn = QKNormAttention(shape)
        self.ffn_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = RoutedMLP(moe) if moe.is_moe(index) else MLP(shape)


class Qwen3OmniThinker(Llama):
    """Embeddings (or given rows), ThinkerLayers, the final norm and the text head
    (PromptRowsHead: text tokens, given prompt rows, the tap's hidden states)."""

    def __init__(
        self,
        shape: LlamaShape,
        moe: DecoderShape,
        max_positions: int,
        tp: TensorParallel = SINGLE,
        tap_layer: int = 0,
    ) -> None:
        if tp.size != 1:
            raise ValueError("the qwen3_omni_moe family runs on one rank (tp_size 1)")
        if not 0 <= tap_layer < shape.num_layers:
            raise ValueError(f"tap_layer {tap_layer} outside 0..{shape.num_layers - 1}")
        super().__init__(shape, max_positions, tp)
        self.moe = moe
        # hidden_states[tap_layer] of transformers: the input of layer tap_layer (0: the
        # embeddings), i.e. the residual stream after layer tap_layer - 1
        self.tap_layer = tap_layer
        self.head = PromptRowsHead(shape.hidden_size)
        self.layers = nn.ModuleList(ThinkerLayer(shape, moe, i) for i in range(shape.num_layers))
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(
        self,
        batch: ForwardBatch,
        k_caches: list[torch.Tensor],  # per layer [S, Hkv, D]
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor:  # [R, V] float32 logits of batch.logits_indices
        given = batch.family_inputs
        if given is None:  # token rows only (every decode step, text prompts)
            return super().forward(batch, k_caches, v_caches)
        assert isinstance(given, PromptRows)
        h = self.embed(batch.input_ids)  # [T, C]
        h = h.index_copy(0, given.rows, given.values.to(h.dtype))
        rope = self.rope_rows(batch.positions)
        h = self._tapped_hidden(h, rope, batch, k_caches, v_caches, given)  # [R, C]
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return self.kernels.linear(h, head, torch.float32)

    def _tapped_hidden(
        self,
        h: torch.Tensor,  # [T, C] the embedded rows
        rope: torch.Tensor,
        batch: ForwardBatch,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        given: PromptRows,
    ) -> torch.Tensor:  # [R, C]: Llama.final_hidden, keeping the tap's rows on the way
        layers = zip(cast(list[DecoderLayer], list(self.layers)), k_caches, v_caches, strict=True)
        deferred = self.kernels.defers_adds(h)
        delta: torch.Tensor | None = None
        for i, (layer, k_cache, v_cache) in enumerate(layers):
            if i == self.tap_layer and given.keeps:
                given.keep(h if delta is None else h + delta)  # the stream is h + delta
            if deferred:
                h, delta = layer.forward_deferred(h, delta, rope, k_cache, v_cache, batch)
            else:
                h = layer(h, rope, k_cache, v_cache, batch)
        rows = batch.logits_indices
        if delta is None:
            return self.norm(sampled_rows(h, rows))
        return self.norm.after_add(sampled_rows(delta, rows), sampled_rows(h, rows))[1]

    def place(
        self, device: torch.device | str, dtype: torch.dtype, cpu_weight_order: str = "rows"
    ) -> Qwen3OmniThinker:
        super().place(device, dtype, cpu_weight_order)
        self._choose_experts(device)
        return self

    def adopt(
        self, weights: Mapping[str, torch.Tensor], device: torch.device | str
    ) -> Qwen3OmniThinker:
        super().adopt(weights, device)
        self._choose_experts(device)
        return self

    def _choose_experts(self, device: torch.device | str) -> None:
        # place() moves parameter data, which bypasses Experts._apply: choose the path here
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.experts.fused = fused_experts_for(torch.device(device))

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Engine names: embed, norm, lm_head, per layer attn_norm, ffn_norm, wq / wk / wv / wo
        (Q / K rows in pair order), q_norm / k_norm (pair order), and w_gate / w_up / w_down
        (dense layers) or router [E, C] and experts_gate / experts_up [E, I, C],
        experts_down [E, C, I] (sparse layers)."""
        put = self.weight_copier()
        with torch.no_grad():
            put("embed.weight", weights["embed"])
            put("norm.weight", weights["norm"])
            if self.lm_head is not None:
                put("lm_head.weight", weights["lm_head"])
            for i in range(self.shape.num_layers):
                w = f"layers.{i}."
                put(w + "attn_norm.weight", weights[w + "attn_norm"])
                put(w + "ffn_norm.weight", weights[w + "ffn_norm"])
                qkv = torch.cat([weights[w + "wq"], weights[w + "wk"], weights[w + "wv"]])
                put(w + "attn.wqkv.weight", qkv)
                put(w + "attn.wo.weight", weights[w + "wo"])
                put(w + "attn.q_norm.weight", weights[w + "q_norm"])
                put(w + "attn.k_norm.weight", weights[w + "k_norm"])
                if self.moe.is_moe(i):
                    put(w + "mlp.moe.gate.weight", weights[w + "router"])
                    put(w + "mlp.moe.experts.gate_proj", weights[w + "experts_gate"])
                    put(w + "mlp.moe.experts.up_proj", weights[w + "experts_up"])
                    put(w + "mlp.moe.experts.down_proj", weights[w + "experts_down"])
                else:
                    gate_up = torch.cat([weights[w + "w_gate"], weights[w + "w_up"]])
                    put(w + "mlp.w_gate_up.weight", gate_up)
                    put(w + "mlp.w_down.weight", weights[w + "w_down"])
