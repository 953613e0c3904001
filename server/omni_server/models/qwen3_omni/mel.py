"""The audio tower's input: Whisper-style log-mel features of 16 kHz audio (128 slaney mel bins
over a 400-point Hann STFT, hop 160: 100 frames a second), as the published
preprocessor_config.json (`WhisperFeatureExtractor`, feature_size 128) computes them, without
transformers: power spectrum -> mel -> log10 (floor 1e-10) -> at most 8 below the clip's
maximum -> (x + 4) / 4. A clip of L samples gives L // 160 frames (the STFT's last is dropped).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160


def _hz_to_mel(freq: np.ndarray) -> np.ndarray:
    """Slaney's scale: linear below 1 kHz, logarithmic above."""
    mels = 3.0 * freq / 200.0
    log_region = freq >= 1000.0
    mels[log_region] = 15.0 + np.log(freq[log_region] / 1000.0) * (27.0 / np.log(6.4))
    return mels


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    freq = 200.0 * mels / 3.0
    log_region = mels >= 15.0
    freq[log_region] = 1000.0 * np.exp(np.log(6.4) / 27.0 * (mels[log_region] - 15.0))
    return freq


@lru_cache(maxsize=4)
def mel_filters(num_mel_bins: int = 128, max_frequency: float = 8000.0) -> torch.Tensor:
    """[n_fft // 2 + 1, num_mel_bins]: triangular filters between mel-spaced edges, each scaled
    to unit area (slaney normalisation)."""
    bins = 1 + N_FFT // 2
    edges_mel = np.linspace(
        _hz_to_mel(np.array([0.0]))[0], _hz_to_mel(np.array([max_frequency]))[0], num_mel_bins + 2
    )
    edges = _mel_to_hz(edges_mel)
    fft_freqs = np.linspace(0, SAMPLE_RATE // 2, bins)
    widths = np.diff(edges)
    slopes = edges[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    filters *= (2.0 / (edges[2 : num_mel_bins + 2] - edges[:num_mel_bins]))[None, :]
    return torch.from_numpy(filters).float()


def log_mel(audio: np.ndarray | torch.Tensor, num_mel_bins: int = 128) -> torch.Tensor:
    """16 kHz mono audio [L] -> features [num_mel_bins, L // 160] (float32)."""
    wave = torch.as_tensor(np.asarray(audio, dtype=np.float32))
    if wave.dim() != 1:
        raise ValueError(f"expected mono audio [samples], got shape {tuple(wave.shape)}")
    if wave.numel() < N_FFT // 2 + 1:
        raise ValueError(f"audio of {wave.numel()} samples is too short for a mel frame")
    stft = torch.stft(wave, N_FFT, HOP, window=torch.hann_window(N_FFT), return_complex=True)
    power = (stft[..., :-1].abs() ** 2).contiguous()  # [bins, frames]
    mel = mel_filters(num_mel_bins).T @ power
    logs = torch.clamp(mel, min=1e-10).log10()
    logs = torch.maximum(logs, logs.max() - 8.0)
    return (logs + 4.0) / 4.0


def frames_for(samples: int) -> int:
    """Mel frames of a clip of `samples` (the feature extractor's attention-mask length)."""
    return samples // HOP
