"""Our code2wav (models/qwen3_omni/code2wav.py) against transformers' `Qwen3OmniMoeCode2Wav` on
tiny random checkpoints: the waveform of 60 frames of random codes, whole and chunked, at
>= 40 dB SNR (in practice fp32 rounding: well above), and audible (RMS ~0.1, not clipped)."""

from __future__ import annotations

import pytest
import torch

from omni_server.models.qwen3_omni.code2wav import Code2Wav
from tests.models.qwen3_omni.conftest import Checkpoint

FRAMES = 60


def snr_db(reference: torch.Tensor, ours: torch.Tensor) -> float:
    noise = (reference - ours).pow(2).sum().clamp_min(1e-30)
    return float(10 * torch.log10(reference.pow(2).sum() / noise))


@pytest.fixture(scope="module")
def code2wav(checkpoint: Checkpoint) -> Code2Wav:
    return Code2Wav.from_checkpoint(checkpoint.folder)


@pytest.fixture(scope="module")
def codes(code2wav: Code2Wav, checkpoint: Checkpoint) -> torch.Tensor:
    shape = code2wav.shape
    gen = torch.Generator().manual_seed(checkpoint.seed + 10)
    return torch.randint(0, shape.codebook_size, (1, shape.num_quantizers, FRAMES), generator=gen)


def test_decode_matches_transformers(
    checkpoint: Checkpoint, code2wav: Code2Wav, codes: torch.Tensor
) -> None:
    with torch.no_grad():
        theirs = checkpoint.reference.code2wav(codes)
    ours = code2wav(codes)
    assert ours.shape == theirs.shape
    # the causal transposed convolutions drop a few hundred trailing samples of the last frame
    assert 0 <= FRAMES * code2wav.shape.samples_per_frame - ours.shape[-1] < 1000
    assert snr_db(theirs, ours) >= 40.0
    rms = float(theirs.pow(2).mean().sqrt())
    assert 0.02 < rms < 0.5 and float(theirs.abs().max()) < 1.0  # audible, not clamped


def test_chunked_decode_matches_transformers(
    checkpoint: Checkpoint, code2wav: Code2Wav, codes: torch.Tensor
) -> None:
    with torch.no_grad():
        theirs = checkpoint.reference.code2wav.chunked_decode(
            codes, chunk_size=16, left_context_size=5
        )
    ours = code2wav.chunked_decode(codes, chunk=16, left_context=5)
    assert ours.shape == theirs.shape
    assert snr_db(theirs, ours) >= 40.0


def test_audio_depends_on_the_codes(code2wav: Code2Wav, codes: torch.Tensor) -> None:
    other = codes.clone()
    other[:, -1, FRAMES // 2 :] = (other[:, -1, FRAMES // 2 :] + 1) % code2wav.shape.codebook_size
    a, b = code2wav(codes), code2wav(other)
    half = FRAMES // 2 * code2wav.shape.samples_per_frame
    assert torch.equal(a[..., : half - 2000], b[..., : half - 2000])  # causal: earlier audio kept
    assert snr_db(a[..., half:], b[..., half:]) < 20.0  # the last code group alone changes it
