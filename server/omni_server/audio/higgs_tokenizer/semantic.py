"""The semantic half of the tokenizer's encoder: HuBERT (16 kHz audio -> one hidden state per 320
samples, averaged over its layers) and the small conv stack after it (`encoder_semantic`).

HuBERT as the published tokenizer configures it: a conv feature extractor (group norm after the
first conv), a layer-normed projection, a grouped positional conv (weight norm folded at load),
then post-norm transformer layers (attention, add, norm; feed-forward, add, norm), no attention
mask (one clip a call). The tokenizer averages HuBERT's input to the first layer and every
layer's output, then keeps every `semantic_downsample_factor`-th frame: 25 a second, as the
acoustic latents. Module and parameter names are the checkpoint's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omni_server.audio.higgs_tokenizer.config import SemanticConfig, TokenizerConfig


class FeatureExtractor(nn.Module):
    def __init__(self, config: SemanticConfig) -> None:
        super().__init__()
        ins = (1, *config.conv_dim[:-1])
        self.conv_layers = nn.ModuleList(
            ConvLayer(i, o, k, s, config.conv_bias, norm=n == 0)
            for n, (i, o, k, s) in enumerate(
                zip(ins, config.conv_dim, config.conv_kernel, config.conv_stride, strict=True)
            )
        )

    def forward(self, audio: torch.Tensor) -> torch.Tensor:  # [B, S] -> [B, C, frames]
        x = audio[:, None]
        for layer in self.conv_layers:
            x = layer(x)
        return x


class ConvLayer(nn.Module):
    def __init__(self, ins: int, outs: int, kernel: int, stride: int, bias: bool, norm: bool):
        super().__init__()
        self.conv = nn.Conv1d(ins, outs, kernel, stride=stride, bias=bias)
        # one group a channel: each channel normed over time (the first layer only)
        self.layer_norm = nn.GroupNorm(outs, outs) if norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return F.gelu(x)


class FeatureProjection(nn.Module):
    def __init__(self, config: SemanticConfig) -> None:
        super().__init__()
        width = config.conv_dim[-1]
        self.layer_norm = (
            nn.LayerNorm(width, eps=config.layer_norm_eps) if config.feat_proj_layer_norm else None
        )
        self.projection = nn.Linear(width, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C] -> [B, T, H]
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return self.projection(x)


class PositionalConv(nn.Module):
    def __init__(self, config: SemanticConfig) -> None:
        super().__init__()
        size = config.num_conv_pos_embeddings
        self.conv = nn.Conv1d(
            config.hidden_size, config.hidden_size, size, padding=size // 2,
            groups=config.num_conv_pos_embedding_groups,
        )  # fmt: skip
        self.trim = 1 if size % 2 == 0 else 0  # an even kernel pads one frame too many

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, H]
        y = self.conv(x.transpose(1, 2))
        if self.trim:
            y = y[:, :, : -self.trim]
        return F.gelu(y).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, config: SemanticConfig) -> None:
        super().__init__()
        width = config.hidden_size
        self.heads = config.num_attention_heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H]
        batch, length, width = x.shape
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (
            p(x).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v)  # [B, heads, T, head_dim]
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, width))


class FeedForward(nn.Module):
    def __init__(self, config: SemanticConfig) -> None:
        super().__init__()
        self.intermediate_dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output_dense = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_dense(F.gelu(self.intermediate_dense(x)))


class EncoderLayer(nn.Module):
    """Post-norm: norm(x + attention(x)), then norm(x + feed_forward(x))."""

    def __init__(self, config: SemanticConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.feed_forward = FeedForward(config)
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_norm(x + self.attention(x))
        return self.final_layer_norm(x + self.feed_forward(x))


class Encoder(nn.Module):
    def __init__(self, config: SemanticConfig) -> None:
        super().__init__()
        self.pos_conv_embed = PositionalConv(config)
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H] -> the mean of the first layer's input and every layer's output."""
        x = self.layer_norm(x + self.pos_conv_embed(x))
        states = [x]
        for layer in self.layers:
            x = layer(x)
            states.append(x)
        return torch.stack(states, dim=1).mean(dim=1)


class Hubert(nn.Module):
    def __init__(self, config: SemanticConfig) -> None:
        super().__init__()
        self.feature_extractor = FeatureExtractor(config)
        self.feature_projection = FeatureProjection(config)
        self.encoder = Encoder(config)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:  # [B, S] 16 kHz -> [B, T, H]
        features = self.feature_extractor(audio).transpose(1, 2)
        return self.encoder(self.feature_projection(features))


class ResidualUnit(nn.Module):
    """elu -> dilated conv -> elu -> 1x1 conv, added to its input (no biases)."""

    def __init__(self, channels: int, kernel: int, dilation: int) -> None:
        super().__init__()
        padding = (kernel - 1) // 2 * dilation
        self.conv1 = nn.Conv1d(
            channels, channels, kernel, padding=padding, dilation=dilation, bias=False
        )
        self.conv2 = nn.Conv1d(channels, channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.elu(self.conv1(F.elu(x))))


class EncoderBlock(nn.Module):
    def __init__(self, config: TokenizerConfig, ins: int, outs: int, stride: int) -> None:
        super().__init__()
        self.res_units = nn.ModuleList(
            ResidualUnit(ins, config.unit_kernel_size, d) for d in config.block_dilations
        )
        kernel = 3 if stride == 1 else 2 * stride
        self.conv = nn.Conv1d(ins, outs, kernel, stride=stride, padding=(kernel - 1) // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for unit in self.res_units:
            x = unit(x)
        return self.conv(x)


class SemanticEncoder(nn.Module):
    """HuBERT's averaged states [B, H, T] -> the semantic latents [B, H', T / prod(strides)]."""

    def __init__(self, config: TokenizerConfig) -> None:
        super().__init__()
        width = config.semantic.hidden_size
        self.conv = nn.Conv1d(
            width, width, config.kernel_size, padding=config.kernel_size // 2, bias=False
        )
        blocks, ins = [], width
        for ratio, stride in zip(config.channel_ratios, config.strides, strict=True):
            outs = int(width * ratio)
            blocks.append(EncoderBlock(config, ins, outs, stride))
            ins = outs
        self.conv_blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        for block in self.conv_blocks:
            x = block(x)
        return x
