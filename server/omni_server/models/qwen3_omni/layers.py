"""The pieces Qwen3-Omni's decoders share: RMSNorm, rotary embeddings (the thinker's and
talker's multimodal interleaved form, the code predictor's plain one), attention with QK-norm
over a KV cache, the dense SwiGLU MLP and the top-k MoE block (a plain path: one matmul pair per
expert actually hit, its tokens gathered together; on CUDA with triton, moe_triton's fused kernel,
chosen once when the experts' weights are placed).

Parameter names are the published checkpoint's below a decoder layer (`self_attn.q_proj.weight`,
`mlp.gate.weight`, `mlp.experts.{e}.gate_proj.weight` stacked into `mlp.experts.gate_proj`, ...)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from omni_server.models.qwen3_omni.config import DecoderShape


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in fp32, the product in the input dtype (as the reference does)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def rotary_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, mrope_section: tuple[int, ...] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] for `positions`: [T] (plain) or [3, T] (temporal, height, width).

    Multimodal rotary, interleaved: frequency i takes the height position when i % 3 == 1 and
    i < 3 * section[1], the width position when i % 3 == 2 and i < 3 * section[2], else the
    temporal one. Text and audio carry the same position on all three axes, which makes it the
    plain rotary."""
    positions = positions.to(inv_freq.device).float()
    if mrope_section is None:
        freqs = positions[:, None] * inv_freq  # [T, D/2]
    else:
        per_axis = positions[..., None] * inv_freq  # [3, T, D/2]
        freqs = per_axis[0].clone()
        for axis in (1, 2):
            picked = slice(axis, 3 * mrope_section[axis], 3)
            freqs[:, picked] = per_axis[axis][:, picked]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos / sin [T, D] (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class KVCache:
    """Keys and values of one sequence batch, sized once: [B, kv_heads, capacity, head_dim] per
    layer. `length` counts the positions held; a forward writes its T new positions at
    [length, length + T) in every layer, then `advance(T)` commits them (the caller's step)."""

    def __init__(
        self,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (batch, num_kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        self.length = 0

    @classmethod
    def for_decoder(
        cls,
        shape: DecoderShape,
        capacity: int,
        batch: int = 1,
        like: torch.Tensor | None = None,
    ) -> KVCache:
        """Sized for `shape`'s layers; dtype and device of `like` (else fp32 on the CPU)."""
        dtype = like.dtype if like is not None else torch.float32
        device = like.device if like is not None else "cpu"
        return cls(
            shape.num_layers, batch, shape.num_kv_heads, shape.head_dim, capacity, dtype, device
        )

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k / v [B, kv, T, D] after the held positions; all keys / values so far."""
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache full: {end} positions, capacity {self.capacity}")
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, count: int) -> None:
        self.length += count


def attention_mask(
    past: int, new: int, window: int | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[new, past + new] bool: query i (at position past + i) sees key j when j <= past + i
    (and past + i - j < window with a sliding window)."""
    q = torch.arange(past, past + new, device=device)[:, None]
    k = torch.arange(past + new, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= q - k < window
    return allowed


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, H, T, D], k / v [B, KV, S, D] (grouped heads) -> [B, T, H * D]."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


class Attention(nn.Module):
    """Grouped-query attention with RMSNorm on each head's query and key (before rotary)."""

    def __init__(self, shape: DecoderShape, qk_norm: bool = True) -> None:
        super().__init__()
        d, h, kv = shape.head_dim, shape.num_heads, shape.num_kv_heads
        self.q_proj = nn.Linear(shape.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(shape.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(shape.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, shape.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, shape.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, shape.rms_norm_eps) if qk_norm else None
        self.head_dim = d

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        kv: KVCache | None,
        layer: int,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim)
        k = self.k_proj(x).view(b, t, -1, self.head_dim)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        if kv is not None:
            k, v = kv.write(layer, k, v)
        return self.o_proj(attend(q, k, v, mask, self.head_dim**-0.5))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Every expert's SwiGLU, stacked: gate_proj / up_proj [E, I, H], down_proj [E, H, I]
    (the checkpoint's `experts.{e}.*.weight`, stacked by `stack_experts`)."""

    def __init__(self, count: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(count, intermediate, hidden))
        self.up_proj = nn.Parameter(torch.empty(count, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(count, hidden, intermediate))
        self.fused: FusedExperts | None = None  # set by `_apply` when the weights reach CUDA

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Experts:
        """Every placement (`.to`, `.cuda`, `.half`, ...) passes here: the path is chosen once,
        for the device the weights now live on, never by a device test per call."""
        super()._apply(fn, recurse)
        self.fused = fused_experts_for(self.gate_proj.device)
        return self

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [N, H]; experts / weights [N, k] -> sum over each token's k experts [N, H].

        On CUDA with triton: the fused kernel (moe_triton.fused_moe, two grouped launches).
        Else the plain path: tokens sorted by expert, one gathered matmul pair per expert hit, in
        ascending expert order (so each token's sum adds in the reference's order)."""
        if self.fused is not None:
            return self.fused(x, experts, weights, self.gate_proj, self.up_proj, self.down_proj)
        out = torch.zeros_like(x)
        top_k = experts.shape[1]
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_proj.shape[0]).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            slots = order[start : start + count]
            start += count
            tokens = slots // top_k
            h = x[tokens]
            h = F.silu(F.linear(h, self.gate_proj[expert])) * F.linear(h, self.up_proj[expert])
            h = F.linear(h, self.down_proj[expert]) * weights.flatten()[slots, None]
            out.index_add_(0, tokens, h.to(out.dtype))
        return out


FusedExperts = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    torch.Tensor,
]


def fused_experts_for(device: torch.device) -> FusedExperts | None:
    """The fused Triton experts for weights on `device`: on CUDA when triton is installed, else
    None (the plain path). moe_triton, and with it triton, is imported only here, on CUDA."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    from omni_server.models.qwen3_omni.moe_triton import fused_moe

    return fused_moe


class Router(nn.Module):
    def __init__(self, count: int, hidden: int, top_k: int, normalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(count, hidden))
        self.top_k = top_k
        self.normalize = normalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (experts [N, k], weights [N, k]): softmax over all experts in fp32, the
        top k kept (renormalised to sum 1 when the config says so)."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(logits.dtype)


class SparseMoE(nn.Module):
    """Top-k routed experts; the talker's adds a shared expert scaled by a sigmoid gate."""

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.gate = Router(shape.num_experts, shape.hidden_size, shape.top_k, shape.norm_topk_prob)
        self.experts = Experts(shape.num_experts, shape.hidden_size, shape.moe_intermediate_size)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shape.shared_expert_size:
            self.shared_expert = MLP(shape.hidden_size, shape.shared_expert_size)
            self.shared_expert_gate = nn.Linear(shape.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = self.gate(flat)
        out = self.experts(flat, experts, weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(flat))
            out = out + gate * self.shared_expert(flat)
        return out.view_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, shape: DecoderShape, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp: nn.Module = (
            SparseMoE(shape)
            if shape.is_moe(layer)
            else MLP(shape.hidden_size, shape.intermediate_size)
        )
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.index = layer

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        kv: KVCache | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv, self.index)
        return x + self.mlp(self.post_attention_layernorm(x))


def stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`...mlp.experts.{e}.gate_proj.weight` (one matrix an expert, as published) ->
    `...mlp.experts.gate_proj` [E, ...] (what `Experts` holds); other names unchanged."""
    import re

    pattern = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    grouped: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, value in tensors.items():
        match = pattern.match(name)
        if match is None:
            out[name] = value
            continue
        grouped.setdefault(f"{match[1]}.{match[3]}", {})[int(match[2])] = value
    for name, by_expert in grouped.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise KeyError(f"{name}: experts {sorted(by_expert)} are not 0..{len(by_expert) - 1}")
        out[name] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out
