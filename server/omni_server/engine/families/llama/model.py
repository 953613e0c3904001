"""A plain-torch Llama decoder over a flat batch of tokens and a paged KV cache.

RMSNorm, RoPE on adjacent pairs (the GGUF's Q/K row order, see gguf.py), grouped-query
attention (attention.py), SwiGLU MLP, tied or separate LM head. The kernels are one backend
object chosen when the model is placed (kernels.py: CPU, torch, Triton): no layer checks the
device. Q/K/V and gate/up are fused into one matmul each: fewer, larger kernels (what decode
speed on CPU and launch count on GPU want). Under tensor parallelism (parallel.py) each rank
holds its share of the heads and of the MLP and one all-reduce closes each half of a block.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from torch import nn

from omni_server.engine.attention import ForwardBatch, paged_attention
from omni_server.engine.config import Llama3RopeScaling, LlamaShape
from omni_server.engine.head import Head
from omni_server.engine.huge_pages import pack_parameters
from omni_server.engine.kernels import CPU, TorchKernels, kernels_for
from omni_server.engine.parallel import SINGLE, TensorParallel
from omni_server.engine.token_head import TokenHead


class RMSNorm(nn.Module):
    kernels: TorchKernels = CPU  # the placed model's backend (Llama.place)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, C]
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def after_add(
        self, delta: torch.Tensor | None, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, norm(h + delta)); delta None: (h, norm(h)). The residual add that
        precedes this norm, and the norm: one kernel where the backend defers adds
        (kernels.py), torch's add then this norm elsewhere (the same roundings)."""
        if delta is None:
            return h, self(h)
        return self.kernels.add_rms_norm(delta, h, self.weight, self.eps)


def rope_table(shape: LlamaShape, max_positions: int) -> torch.Tensor:
    """[max_positions, D/2] complex64: e^(i * position * theta^(-2j/D)) (Llama 3 scaled, if set)."""
    d = shape.head_dim
    inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if shape.rope_scaling is not None:
        inv_freq = _llama3_inv_freq(inv_freq, shape.rope_scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.polar(torch.ones_like(angles), angles)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """[D/2] frequencies scaled as transformers' `_compute_llama3_parameters` (same float32 ops,
    so the table equals theirs bit for bit before the cos / sin)."""
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def sampled_rows(h: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
    """h[logits_indices]. The indices rise (decodes, then each finished chunk's last token),
    so as many as h has rows are all of them in order: h itself, no copy (every decode step)."""
    if logits_indices.shape[0] == h.shape[0]:
        return h
    return h.index_select(0, logits_indices)


class Attention(nn.Module):
    """`shape` is this rank's share (local heads); the output is summed over the ranks."""

    kernels: TorchKernels = CPU

    def __init__(self, shape: LlamaShape, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = shape.num_heads
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        q_size = shape.num_heads * shape.head_dim
        kv_size = shape.num_kv_heads * shape.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.wqkv = nn.Linear(shape.hidden_size, q_size + 2 * kv_size, bias=False)
        self.wo = nn.Linear(q_size, shape.hidden_size, bias=False)  # row-parallel

    def forward(
        self,
        x: torch.Tensor,  # [T, C]
        rope: torch.Tensor,  # [T, 1, D/2] complex64
        k_cache: torch.Tensor,  # [S, Hkv, D]
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        residual: torch.Tensor | None = None,  # [T, C]: added to the output if given
    ) -> torch.Tensor:  # [T, C]
        # The Linear modules hold the weights; calling F.linear skips a module call per matmul.
        t, kernels = x.shape[0], self.kernels
        qkv = kernels.linear(x, self.wqkv.weight)  # [T, (H + 2 Hkv) D]
        # RoPE on Q and K, K / V written to the cache (first: each token then attends to
        # itself through the cache like any other key)
        q = kernels.rope_and_cache(qkv, rope, batch.slot_mapping, k_cache, v_cache, self.num_heads)
        out = paged_attention(q, k_cache, v_cache, batch)  # [T, H, D]
        return kernels.project(out.view(t, -1), self.wo.weight, self.tp, residual)


class MLP(nn.Module):
    """`shape` is this rank's share (local width); the output is summed over the ranks."""

    kernels: TorchKernels = CPU

    def __init__(self, shape: LlamaShape, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.w_gate_up = nn.Linear(shape.hidden_size, 2 * shape.intermediate_size, bias=False)
        self.w_down = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [T, C]
        residual: torch.Tensor | None = None,  # [T, C]: added to the output if given
    ) -> torch.Tensor:  # [T, C]
        gate_up = self.kernels.linear(x, self.w_gate_up.weight)  # [T, 2I]
        return self.kernels.swiglu_down(gate_up, self.w_down.weight, self.tp, residual)


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.attn = Attention(shape, tp)
        self.ffn_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape, tp)

    def forward(
        self,
        h: torch.Tensor,
        rope: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        h = self.attn(self.attn_norm(h), rope, k_cache, v_cache, batch, residual=h)
        return self.mlp(self.ffn_norm(h), residual=h)

    def forward_deferred(
        self,
        h: torch.Tensor,  # [T, C] the residual stream, less `delta`
        delta: torch.Tensor | None,  # [T, C] the previous layer's MLP output, not yet added
        rope: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # (h, delta): the stream is h + delta
        """forward() with each residual add done by the norm after it (RMSNorm.after_add):
        the MLP's add waits for the next layer's attention norm (or the final norm)."""
        h, x = self.attn_norm.after_add(delta, h)
        h, x = self.ffn_norm.after_add(self.attn(x, rope, k_cache, v_cache, batch), h)
        return h, self.mlp(x)


class Llama(nn.Module):
    # A family's variant (higgs_audio_v2) swaps the layer, drops the text head, adds its own.
    layer_class: type[DecoderLayer] = DecoderLayer
    text_head = True
    # What a step emits and how it is sampled (head.py): a text token, the vocabulary logits;
    # one a model (it holds the model's draw graphs)
    head: Head[Any]
    kernels: TorchKernels = CPU  # set with the device (place, adopt): kernels.py

    def __init__(self, shape: LlamaShape, max_positions: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.head = TokenHead()
        self.shape = shape  # the whole model's
        self.tp = tp
        self.local_shape = tp.local_shape(shape)  # this rank's share: what its KV cache holds
        self.embed = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_class(self.local_shape, tp) for _ in range(shape.num_layers)
        )
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head: nn.Linear | None = None
        if self.text_head and not shape.tie_word_embeddings:
            self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        # [P, D/2] complex64; a plain attribute, not a buffer, so a dtype cast never touches it.
        # Built on the CPU even when the weights are built on the meta device (from_random).
        with torch.device("cpu"):
            self.rope = rope_table(shape, max_positions)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(
        self,
        batch: ForwardBatch,
        k_caches: list[torch.Tensor],  # per layer [S, Hkv, D]
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor:  # [R, V] float32 logits of batch.logits_indices
        h = self.embed(batch.input_ids)  # [T, C]
        rope = self.rope_rows(batch.positions)  # [T, 1, D/2]
        h = self.final_hidden(h, rope, batch, k_caches, v_caches)  # [R, C]: the head only there
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return self.kernels.linear(h, head, torch.float32)

    def final_hidden(
        self,
        h: torch.Tensor,  # [T, C] the embedded rows
        rope: torch.Tensor,
        batch: ForwardBatch,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
    ) -> torch.Tensor:  # [R, C]: the final norm of batch.logits_indices' rows
        rows = batch.logits_indices
        decoder = cast(list[DecoderLayer], list(self.layers))
        layers = zip(decoder, k_caches, v_caches, strict=True)
        if not self.kernels.defers_adds(h):
            for layer, k_cache, v_cache in layers:
                h = layer(h, rope, k_cache, v_cache, batch)
            return self.norm(sampled_rows(h, rows))
        delta: torch.Tensor | None = None
        for layer, k_cache, v_cache in layers:
            h, delta = layer.forward_deferred(h, delta, rope, k_cache, v_cache, batch)
        if delta is not None:  # the last MLP's add, on the sampled rows only
            delta = sampled_rows(delta, rows)
        return self.norm.after_add(delta, sampled_rows(h, rows))[1]

    def rope_rows(self, positions: torch.Tensor) -> torch.Tensor:  # [T] -> [T, 1, D/2]
        # index_select, not advanced indexing (attention._gather says why)
        return self.rope.index_select(0, positions).unsqueeze(1)

    def place(
        self, device: torch.device | str, dtype: torch.dtype, cpu_weight_order: str = "rows"
    ) -> Llama:
        """Move to `device`, weights in `dtype`; the RoPE table stays complex64. Weights built
        on the meta device get uninitialized storage (init_random or load_weights fill it).
        On the CPU the weights go into one buffer of huge pages (huge_pages.py), the wide
        matmul weights by columns if `cpu_weight_order` is "columns" (EngineConfig)."""
        self.rope = self.rope.to(device)
        self.use_kernels(kernels_for(device))
        if torch.device(device).type == "cpu":
            by_columns = self.matmul_weights() if cpu_weight_order == "columns" else set()
            pack_parameters(self, dtype, by_columns)
            return self
        for module in self.modules():
            for name, p in module.named_parameters(recurse=False):
                if p.is_meta:  # a meta tensor cannot take real data: a new parameter
                    empty = torch.empty(p.shape, device=device, dtype=dtype)
                    setattr(module, name, nn.Parameter(empty, requires_grad=False))
                else:
                    p.data = p.data.to(device=device, dtype=dtype)
        return self

    def adopt(self, weights: Mapping[str, torch.Tensor], device: torch.device | str) -> Llama:
        """Make `weights` the parameters themselves (no copy: a sharing follower's tensors alias
        its leader's memory; the caller checked names, shapes, dtype and device), the RoPE
        table and the kernels on `device`."""
        self.load_state_dict(dict(weights), strict=True, assign=True)
        self.rope = self.rope.to(device)
        self.use_kernels(kernels_for(device))
        return self

    def use_kernels(self, kernels: TorchKernels) -> None:
        """Every module of the model calls `kernels` (chosen once, for the device)."""
        for module in self.modules():
            if isinstance(module, (Llama, RMSNorm, Attention, MLP)):
                module.kernels = kernels

    def matmul_weights(self) -> set[str]:
        """The parameters a step multiplies by: every Linear's, and the embedding where the
        text head is tied to it (huge_pages.columns_first may store those by columns)."""
        names = {
            f"{prefix}.weight"
            for prefix, module in self.named_modules()
            if isinstance(module, nn.Linear)
        }
        if self.text_head and self.lm_head is None:
            names.add("embed.weight")
        return names

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy engine-named float32 weights in (gguf_weights names), fusing QKV and gate/up."""
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
                put(
                    w + "mlp.w_gate_up.weight",
                    torch.cat([weights[w + "w_gate"], weights[w + "w_up"]]),
                )
                put(w + "mlp.w_down.weight", weights[w + "w_down"])

    def weight_copier(self) -> Callable[[str, torch.Tensor], None]:
        """`put(name, full)`: copy a whole (unsharded) weight into parameter `name` as this
        rank's shard, refusing a shape that disagrees (a checkpoint of another shape)."""
        params = dict(self.named_parameters())

        def put(name: str, value: torch.Tensor) -> None:
            target = params[name]
            value = self.shard(name, value)
            if target.shape != value.shape:
                raise ValueError(f"weight {name}: shape {tuple(value.shape)} != {target.shape}")
            target.copy_(value)

        return put

    def init_random(self, seed: int = 0) -> None:
        """Random weights (benchmarks: speed does not depend on values; tests of scheduling).

        Unit-variance embeddings and 1/sqrt(fan_in) matrices, so every layer moves the residual
        stream and greedy outputs vary with the context instead of repeating one token. Drawn on
        the weights' device, whole (unsharded) and then sliced, so every tp_size gives the same
        model.
        """
        gen: torch.Generator | None = None
        with torch.no_grad():
            for name, p in self.named_parameters():
                if gen is None:
                    gen = torch.Generator(device=p.device).manual_seed(seed)
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                    continue
                full = self.full_shape(name, p)
                std = 1.0 if name.startswith("embed") else full[1] ** -0.5  # embed, embed_audio
                value = torch.randn(full, generator=gen, device=p.device, dtype=torch.float32)
                p.copy_(self.shard(name, value.mul_(std)))

    # --- tensor parallelism -------------------------------------------------------------------

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the whole weight `name` (the whole of a replicated one)."""
        tp, shape = self.tp, self.shape
        if name.endswith("attn.wqkv.weight"):
            q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
            return tp.rows(full, (q, kv, kv))
        if name.endswith("mlp.w_gate_up.weight"):
            return tp.rows(full, (shape.intermediate_size, shape.intermediate_size))
        if name.endswith(("attn.wo.weight", "mlp.w_down.weight")):
            return tp.columns(full)
        return full

    def full_shape(self, name: str, local: torch.Tensor) -> tuple[int, ...]:
        """The unsharded shape of parameter `name` (local: this rank's slice of it)."""
        rows, *rest = local.shape
        if name.endswith(("attn.wqkv.weight", "mlp.w_gate_up.weight")):
            return (rows * self.tp.size, *rest)
        if name.endswith(("attn.wo.weight", "mlp.w_down.weight")):
            return (rows, rest[0] * self.tp.size)
        return tuple(local.shape)
