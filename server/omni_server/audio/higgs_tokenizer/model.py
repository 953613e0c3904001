"""Higgs Audio v2's audio tokenizer: 24 kHz audio <-> frames of `num_quantizers` codes, 25 a second.

encode: the clip's acoustic latents (DAC encoder) and semantic latents (HuBERT at 16 kHz, then
a conv stack), concatenated channel-wise, projected (`fc`), then residual vector quantization:
each quantizer projects the residual left by the ones before it to its codebook's space and
takes the nearest code (Euclidean), and its code's vector, projected back, is subtracted.

decode: the sum over quantizers of each code's vector projected back, projected to the
acoustic latent (`fc2`), then the DAC decoder. The projections are affine, so that sum is a sum
of rows of one table per quantizer (code -> its contribution to the acoustic latent), folded
once at load in float64: decoding a window is one gather, one sum and the decoder's convs (the
vocoder replays it from CUDA graphs: audio/decode_graphs.py).

Shapes: audio [B, 1, S]; codes [B, K, L] int64; decode gives [B, 1, L * hop].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from omni_server.audio.higgs_tokenizer.acoustic import AcousticDecoder, AcousticEncoder
from omni_server.audio.higgs_tokenizer.config import TokenizerConfig
from omni_server.audio.higgs_tokenizer.resample import resample
from omni_server.audio.higgs_tokenizer.semantic import Hubert, SemanticEncoder

HUBERT_PAD = 160  # samples of silence each side of the 16 kHz clip, as the reference pads it


class Codebook(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(size, dim))  # code -> vector


class Quantizer(nn.Module):
    def __init__(self, config: TokenizerConfig) -> None:
        super().__init__()
        self.codebook = Codebook(config.codebook_size, config.codebook_dim)
        self.project_in = nn.Linear(config.hidden_size, config.codebook_dim)
        self.project_out = nn.Linear(config.codebook_dim, config.hidden_size)

    def nearest(self, residual: torch.Tensor) -> torch.Tensor:  # [B, D, L] -> codes [B, L]
        x = self.project_in(residual.permute(0, 2, 1))  # [B, L, d]
        flat = x.reshape(-1, x.shape[-1])
        embed = self.codebook.embed.t()  # [d, N]
        # the squared distance expanded, as the reference computes it (the same float ops, so
        # the same nearest code where two are almost as near)
        distance = (
            flat.pow(2).sum(1, keepdim=True) - 2 * flat @ embed + embed.pow(2).sum(0, keepdim=True)
        )
        return (-distance).max(dim=-1).indices.view(x.shape[:-1])

    def vectors(self, codes: torch.Tensor) -> torch.Tensor:  # [B, L] -> [B, D, L]
        return self.project_out(F.embedding(codes, self.codebook.embed)).permute(0, 2, 1)


class Quantization(nn.Module):
    def __init__(self, config: TokenizerConfig) -> None:
        super().__init__()
        self.quantizers = nn.ModuleList(Quantizer(config) for _ in range(config.num_quantizers))

    def each(self) -> list[Quantizer]:
        return cast(list[Quantizer], list(self.quantizers))

    def encode(self, latent: torch.Tensor) -> torch.Tensor:  # [B, D, L] -> [B, K, L]
        codes, residual = [], latent
        for quantizer in self.each():
            code = quantizer.nearest(residual)
            residual = residual - quantizer.vectors(code)
            codes.append(code)
        return torch.stack(codes, dim=1)


class HiggsAudioTokenizer(nn.Module):
    """The tokenizer's modules, named as the checkpoint's tensors. Build with
    `higgs_tokenizer.load(folder, device)`, which fills the weights and the decode table."""

    decode_table: torch.Tensor  # buffers (register_buffer)
    code_offsets: torch.Tensor

    def __init__(self, config: TokenizerConfig) -> None:
        super().__init__()
        self.config = config
        # 24 -> 16 kHz for HuBERT: torchaudio's algorithm (resample.py); tests that compare
        # with a reference resampling otherwise set its function here
        self.semantic_resample: Callable[[torch.Tensor, int, int], torch.Tensor] = resample
        self.acoustic_encoder = AcousticEncoder(config.acoustic)
        self.acoustic_decoder = AcousticDecoder(config.acoustic)
        self.semantic_model = Hubert(config.semantic)
        self.encoder_semantic = SemanticEncoder(config)
        self.fc = nn.Linear(config.hidden_size, config.hidden_size)
        self.fc2 = nn.Linear(config.hidden_size, config.acoustic.hidden_size)
        self.quantizer = Quantization(config)
        k, n = config.num_quantizers, config.codebook_size
        # code k * N + c -> quantizer k's code c in the acoustic latent (fc2's bias in row 0's
        # quantizer: every frame gathers exactly one row of each); filled by fold_decode_table
        self.register_buffer(
            "decode_table", torch.zeros(k * n, config.acoustic.hidden_size), persistent=False
        )
        self.register_buffer("code_offsets", torch.arange(k).view(1, k, 1) * n, persistent=False)

    @torch.no_grad()
    def fold_decode_table(self) -> None:
        """decode_table from the quantizers' codebooks and projections and fc2 (after load)."""
        w2 = self.fc2.weight.double()  # [A, D]
        rows = []
        for index, quantizer in enumerate(self.quantizer.each()):
            vectors = F.linear(
                quantizer.codebook.embed.double(),
                quantizer.project_out.weight.double(),
                quantizer.project_out.bias.double(),
            )  # [N, D]
            part = vectors @ w2.t()  # [N, A]
            if index == 0:
                part = part + self.fc2.bias.double()
            rows.append(part)
        self.decode_table.copy_(torch.cat(rows).to(self.decode_table.dtype))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:  # [B, K, L] -> [B, 1, L * hop]
        latent = F.embedding(codes + self.code_offsets, self.decode_table).sum(dim=1)  # [B, L, A]
        return self.acoustic_decoder(latent.transpose(1, 2))

    def encode(self, audio: torch.Tensor) -> torch.Tensor:  # [B, 1, S] 24 kHz -> [B, K, L]
        if audio.dim() != 3 or audio.shape[1] != 1:
            raise ValueError(f"audio must be [batch, 1, samples]; got {tuple(audio.shape)}")
        semantic = self.encoder_semantic(self.semantic_features(audio).transpose(1, 2))
        # the acoustic encoder gives one latent a hop only once the clip is padded by half a
        # hop each side; the reference pads exactly where the unpadded count would differ
        if self.acoustic_encoder.frames(audio.shape[-1]) != semantic.shape[-1]:
            pad = self.config.hop_length // 2
            audio = F.pad(audio, (pad, pad))
        acoustic = self.acoustic_encoder(audio)
        latent = torch.cat([acoustic, semantic], dim=1)  # [B, D, L]
        latent = self.fc(latent.transpose(1, 2)).transpose(1, 2)
        return self.quantizer.encode(latent)

    def semantic_features(self, audio: torch.Tensor) -> torch.Tensor:  # -> [B, T, H]
        config = self.config
        wave = self.semantic_resample(audio, config.sample_rate, config.semantic_sample_rate)[
            :, 0, :
        ]
        states = self.semantic_model(F.pad(wave, (HUBERT_PAD, HUBERT_PAD)))
        return states[:, :: config.semantic_downsample_factor, :]
