"""code2wav (published: code2wav.*): frames of G codes -> 24 kHz audio, 1920 samples a frame
(12.5 frames a second).

    mean of the G codes' embeddings (one table, code group g at offset g * codebook_size)
    -> a causal transformer with a sliding window (layer scales, no QK-norm)
    -> 2 x (causal transposed conv x2 + ConvNeXt block)        (x4 in time)
    -> causal conv, 4 decoder blocks (SnakeBeta, causal transposed conv x8 / x5 / x4 / x3,
       3 residual units of dilation 1, 3, 9), SnakeBeta, causal conv to 1 channel
    -> clamped to [-1, 1]

Everything is causal: a sample depends on its frame and the frames before it only, which is
what lets `chunked_decode` cut a long stream into chunks with a little left context.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from omni_server.models.qwen3_omni.config import Code2WavShape, Qwen3OmniConfig
from omni_server.models.qwen3_omni.layers import (
    MLP,
    RMSNorm,
    apply_rotary,
    attend,
    attention_mask,
    inverse_frequencies,
    rotary_cos_sin,
)
from omni_server.models.qwen3_omni.weights import CheckpointWeights, load_into


class CausalConv(nn.Module):
    """Conv1d padded on the left by (effective kernel - stride), plus what makes the last
    window whole."""

    def __init__(
        self, cin: int, cout: int, kernel: int, dilation: int = 1, stride: int = 1, groups: int = 1
    ) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride=stride, dilation=dilation, groups=groups)
        self.stride = stride
        self.kernel = (kernel - 1) * dilation + 1
        self.padding = self.kernel - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        frames = (length - self.kernel + self.padding) / self.stride + 1
        ideal = (math.ceil(frames) - 1) * self.stride + (self.kernel - self.padding)
        return self.conv(F.pad(x, (self.padding, ideal - length)))


class CausalTransposeConv(nn.Module):
    """ConvTranspose1d with (kernel - stride) samples trimmed at each end."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.trim = kernel - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return x[..., self.trim : x.shape[-1] - self.trim]


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T]
        h = self.norm(self.dwconv(x).transpose(1, 2))
        h = self.gamma * self.pwconv2(F.gelu(self.pwconv1(h)))
        return x + h.transpose(1, 2)


class SnakeBeta(nn.Module):
    """x + sin^2(x * e^alpha) / e^beta, per channel."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = torch.exp(self.alpha)[None, :, None]
        beta = torch.exp(self.beta)[None, :, None]
        return x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    def __init__(self, cin: int, cout: int, rate: int) -> None:
        super().__init__()
        units = [ResidualUnit(cout, d) for d in (1, 3, 9)]
        self.block = nn.ModuleList(
            [SnakeBeta(cin), CausalTransposeConv(cin, cout, 2 * rate, rate), *units]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self.block:
            x = module(x)
        return x


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class WindowAttention(nn.Module):
    def __init__(self, shape: Code2WavShape) -> None:
        super().__init__()
        self.head_dim = shape.hidden_size // shape.num_heads
        h, kv, d = shape.num_heads, shape.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(shape.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(shape.hidden_size, kv * d, bias=False)
        self.v_proj = nn.Linear(shape.hidden_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, shape.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(attend(q, k, v, mask, self.head_dim**-0.5))


class TransformerLayer(nn.Module):
    def __init__(self, shape: Code2WavShape) -> None:
        super().__init__()
        self.self_attn = WindowAttention(shape)
        self.mlp = MLP(shape.hidden_size, shape.intermediate_size)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(shape.hidden_size)
        self.mlp_layer_scale = LayerScale(shape.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, shape: Code2WavShape) -> None:
        super().__init__()
        self.shape = shape
        self.layers = nn.ModuleList(TransformerLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        head_dim = shape.hidden_size // shape.num_heads
        self.register_buffer(
            "inv_freq", inverse_frequencies(head_dim, shape.rope_theta), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, hidden]
        t = x.shape[1]
        cos, sin = rotary_cos_sin(torch.arange(t, device=x.device), self.inv_freq, None)
        mask = attention_mask(0, t, window=self.shape.sliding_window, device=x.device)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


class Code2Wav(nn.Module):
    code_offset: torch.Tensor  # [1, G, 1]: group g's codes at g * codebook_size

    def __init__(self, shape: Code2WavShape) -> None:
        super().__init__()
        self.shape = shape
        h = shape.hidden_size
        self.code_embedding = nn.Embedding(shape.codebook_size * shape.num_quantizers, h)
        self.pre_transformer = PreTransformer(shape)
        self.upsample = nn.ModuleList(
            nn.Sequential(CausalTransposeConv(h, h, r, r), ConvNeXtBlock(h))
            for r in shape.upsampling_ratios
        )
        dims = [shape.decoder_dim // 2**i for i in range(len(shape.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [
                CausalConv(h, dims[0], 7),
                *(
                    DecoderBlock(dims[i], dims[i + 1], r)
                    for i, r in enumerate(shape.upsample_rates)
                ),
                SnakeBeta(dims[-1]),
                CausalConv(dims[-1], 1, 7),
            ]
        )
        offsets = torch.arange(shape.num_quantizers).view(1, -1, 1) * shape.codebook_size
        self.register_buffer("code_offset", offsets, persistent=False)

    @classmethod
    def from_checkpoint(cls, folder: Path | str, dtype: torch.dtype = torch.float32) -> Code2Wav:
        config = Qwen3OmniConfig.from_folder(folder)
        model = cls(config.code2wav)
        load_into(model, CheckpointWeights(folder).prefixed("code2wav.", dtype))
        return model.to(dtype).eval()

    @torch.no_grad()
    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, G, frames] -> audio [B, 1, frames * samples_per_frame] in [-1, 1]."""
        if codes.shape[1] != self.shape.num_quantizers:
            raise ValueError(
                f"expected {self.shape.num_quantizers} code groups, got {codes.shape[1]}"
            )
        x = self.code_embedding(codes + self.code_offset).mean(1)
        x = self.pre_transformer(x).transpose(1, 2)
        for stage in self.upsample:
            x = stage(x)
        for module in self.decoder:
            x = module(x)
        return x.clamp(-1.0, 1.0)

    @torch.no_grad()
    def chunked_decode(
        self, codes: torch.Tensor, chunk: int = 300, left_context: int = 25
    ) -> torch.Tensor:
        """Decode `chunk` frames at a time, each with up to `left_context` frames before it
        decoded again and their audio dropped (the reference's chunked decode)."""
        pieces, start, step = [], 0, self.shape.samples_per_frame
        while start < codes.shape[-1]:
            end = min(start + chunk, codes.shape[-1])
            context = left_context if start - left_context > 0 else start
            pieces.append(self(codes[..., start - context : end])[..., context * step :])
            start = end
        return torch.cat(pieces, dim=-1)


def lookahead_frames(shape: Code2WavShape) -> int:
    """Frames after a frame that its samples depend on: each decoder block's transposed
    convolution (kernel 2 x rate, `rate` trimmed at each end) looks one of its input samples
    ahead, `rate x the later blocks' rates` output samples; the causal convolutions none. 1 for
    the published shape (about 555 of a frame's 1920 samples)."""
    ahead, scale = 0, 1
    for rate in reversed(shape.upsample_rates):
        scale *= rate
        ahead += scale
    return -(-ahead // shape.samples_per_frame)
