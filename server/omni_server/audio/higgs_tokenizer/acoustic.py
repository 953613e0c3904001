"""The acoustic half of the tokenizer: a DAC encoder (24 kHz audio -> one latent a hop) and the
DAC decoder Higgs changed (every transposed conv's output_padding is stride % 2, so a frame
decodes to exactly hop samples, and no tanh on the output).

Every conv is "same"-padded except the strided ones, so lengths only change in the blocks:
the encoder's block of stride s maps L samples to (L + 2 * ceil(s / 2) - 2 * s) // s + 1, the
decoder's multiplies by s. Module and parameter names are the checkpoint's (its safetensors
load as they are); weight norm, where a checkpoint still has it, is folded at load.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from omni_server.audio.higgs_tokenizer.config import AcousticConfig


class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha, alpha learned per channel."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T]
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


class ResidualUnit(nn.Module):
    """snake -> dilated conv (kernel 7) -> snake -> 1x1 conv, added to its input."""

    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.snake1 = Snake(channels)
        self.conv1 = nn.Conv1d(channels, channels, 7, dilation=dilation, padding=3 * dilation)
        self.snake2 = Snake(channels)
        self.conv2 = nn.Conv1d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.snake2(self.conv1(self.snake1(x))))


class EncoderBlock(nn.Module):
    """Three residual units at `channels`, then a strided conv to 2 x channels."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.res_unit1 = ResidualUnit(channels, 1)
        self.res_unit2 = ResidualUnit(channels, 3)
        self.res_unit3 = ResidualUnit(channels, 9)
        self.snake1 = Snake(channels)
        self.conv1 = nn.Conv1d(
            channels, 2 * channels, 2 * stride, stride=stride, padding=math.ceil(stride / 2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.res_unit3(self.res_unit2(self.res_unit1(x)))
        return self.conv1(self.snake1(x))


class AcousticEncoder(nn.Module):
    def __init__(self, config: AcousticConfig) -> None:
        super().__init__()
        width = config.encoder_hidden_size
        self.strides = config.downsampling_ratios
        self.conv1 = nn.Conv1d(1, width, 7, padding=3)
        self.block = nn.ModuleList(
            EncoderBlock(width * 2**i, stride) for i, stride in enumerate(self.strides)
        )
        width *= 2 ** len(self.strides)
        self.snake1 = Snake(width)
        self.conv2 = nn.Conv1d(width, config.hidden_size, 3, padding=1)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:  # [B, 1, S] -> [B, hidden, frames]
        x = self.conv1(audio)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))

    def frames(self, samples: int) -> int:
        """Latents out for `samples` in (the strided convs' arithmetic; the rest keep length)."""
        for stride in self.strides:
            samples = (samples + 2 * math.ceil(stride / 2) - 2 * stride) // stride + 1
        return samples


class DecoderBlock(nn.Module):
    """snake -> transposed conv (x stride, channels halved) -> three residual units."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.snake1 = Snake(channels)
        self.conv_t1 = nn.ConvTranspose1d(
            channels, channels // 2, 2 * stride, stride=stride,
            padding=math.ceil(stride / 2), output_padding=stride % 2,
        )  # fmt: skip
        self.res_unit1 = ResidualUnit(channels // 2, 1)
        self.res_unit2 = ResidualUnit(channels // 2, 3)
        self.res_unit3 = ResidualUnit(channels // 2, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_t1(self.snake1(x))
        return self.res_unit3(self.res_unit2(self.res_unit1(x)))


class AcousticDecoder(nn.Module):
    def __init__(self, config: AcousticConfig) -> None:
        super().__init__()
        width = config.decoder_hidden_size
        self.conv1 = nn.Conv1d(config.hidden_size, width, 7, padding=3)
        self.block = nn.ModuleList(
            DecoderBlock(width // 2**i, stride) for i, stride in enumerate(config.upsampling_ratios)
        )
        width //= 2 ** len(config.upsampling_ratios)
        self.snake1 = Snake(width)
        self.conv2 = nn.Conv1d(width, 1, 7, padding=3)

    def forward(self, latent: torch.Tensor) -> torch.Tensor:  # [B, hidden, L] -> [B, 1, L * hop]
        x = self.conv1(latent)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))
