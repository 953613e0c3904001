"""The thinker's audio tower (published: thinker.audio_tower.*): log-mel features -> one
embedding per 80 ms, in the thinker's hidden size.

    mel frames, cut into chunks of 2 * n_window (100) frames (the last may be shorter; all are
      right-padded with zeros to the longest chunk of the call, as the reference does)
    -> three 3x3 stride-2 convolutions with GELU (8x down in time and in mel bins)
    -> conv_out to d_model, + sinusoidal positions (restarting in every chunk)
    -> the valid positions of every chunk, concatenated (13 per full chunk)
    -> pre-LN transformer layers, attention inside windows of n_window_infer mel frames
       (full windows of every clip, then its remainder), never across clips
    -> ln_post, proj1, GELU, proj2 (to the thinker's hidden size)
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from omni_server.models.qwen3_omni.config import AudioEncoderShape, Qwen3OmniConfig
from omni_server.models.qwen3_omni.weights import CheckpointWeights, load_into


def output_lengths(mel_frames: torch.Tensor, n_window: int = 50) -> torch.Tensor:
    """Embeddings the tower gives for clips of `mel_frames` (the count of audio placeholder
    tokens the prompt carries): 13 per full chunk of 2 * n_window frames, plus the tail's."""
    chunk = n_window * 2
    tail = mel_frames % chunk
    after = (tail - 1) // 2 + 1
    return ((after - 1) // 2 + 1 - 1) // 2 + 1 + (mel_frames // chunk) * 13


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-increment * torch.arange(channels // 2).float())
    scaled = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


class EncoderAttention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.heads = heads

    def forward(self, x: torch.Tensor, windows: list[int]) -> torch.Tensor:
        """x [N, d]; bidirectional attention inside each window (lengths summing to N)."""
        n, d = x.shape
        head_dim = d // self.heads
        q, k, v = (
            p(x).view(n, self.heads, head_dim).transpose(0, 1)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        outs = []
        for qs, ks, vs in zip(*(t.split(windows, dim=1) for t in (q, k, v)), strict=True):
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, scale=head_dim**-0.5))
        return self.out_proj(torch.cat(outs, dim=1).transpose(0, 1).reshape(n, d))


class EncoderLayer(nn.Module):
    def __init__(self, shape: AudioEncoderShape) -> None:
        super().__init__()
        self.self_attn = EncoderAttention(shape.d_model, shape.num_heads)
        self.self_attn_layer_norm = nn.LayerNorm(shape.d_model)
        self.fc1 = nn.Linear(shape.d_model, shape.ffn_dim)
        self.fc2 = nn.Linear(shape.ffn_dim, shape.d_model)
        self.final_layer_norm = nn.LayerNorm(shape.d_model)

    def forward(self, x: torch.Tensor, windows: list[int]) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), windows)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    positions: torch.Tensor  # [max_source_positions, d_model] sinusoids

    def __init__(self, shape: AudioEncoderShape) -> None:
        super().__init__()
        self.shape = shape
        hidden = shape.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, hidden, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        bins = ((shape.num_mel_bins + 1) // 2 + 1) // 2
        self.conv_out = nn.Linear(hidden * ((bins + 1) // 2), shape.d_model, bias=False)
        self.layers = nn.ModuleList(EncoderLayer(shape) for _ in range(shape.num_layers))
        self.ln_post = nn.LayerNorm(shape.d_model)
        self.proj1 = nn.Linear(shape.d_model, shape.d_model)
        self.proj2 = nn.Linear(shape.d_model, shape.output_dim)
        self.register_buffer(
            "positions", sinusoids(shape.max_source_positions, shape.d_model), persistent=False
        )

    @classmethod
    def from_checkpoint(
        cls, folder: Path | str, dtype: torch.dtype = torch.float32
    ) -> AudioEncoder:
        config = Qwen3OmniConfig.from_folder(folder)
        model = cls(config.audio)
        load_into(model, CheckpointWeights(folder).prefixed("thinker.audio_tower.", dtype))
        return model.to(dtype).eval()

    def forward(self, features: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """features [mel_bins, sum(lengths)] (the clips' frames one after another) ->
        embeddings [sum(output_lengths(lengths)), output_dim], clip after clip."""
        chunk = self.shape.n_window * 2
        chunk_lengths = []
        for length in lengths:
            full, tail = divmod(length, chunk)
            chunk_lengths += [chunk] * full + ([tail] if tail else [])
        pieces = features.T.split(chunk_lengths, dim=0)
        padded = nn.utils.rnn.pad_sequence(list(pieces), batch_first=True).transpose(1, 2)
        x = padded.unsqueeze(1).to(self.conv2d1.weight.dtype)  # [chunks, 1, bins, frames]
        x = F.gelu(self.conv2d3(F.gelu(self.conv2d2(F.gelu(self.conv2d1(x))))))
        c, ch, f, t = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(c, t, ch * f))
        x = x + self.positions[:t].to(x.dtype)
        valid = output_lengths(torch.tensor(chunk_lengths), self.shape.n_window).tolist()
        x = torch.cat([x[i, :n] for i, n in enumerate(valid)])
        # attention windows: n_window_infer mel frames' worth of the longest chunk's outputs
        window = max(valid) * (self.shape.n_window_infer // chunk)
        windows = []
        for n in output_lengths(torch.tensor(lengths), self.shape.n_window).tolist():
            windows += [window] * (n // window) + ([n % window] if n % window else [])
        for layer in self.layers:
            x = layer(x, windows)
        return self.proj2(F.gelu(self.proj1(self.ln_post(x))))
