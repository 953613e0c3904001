"""Counter-based seeded draws as pure tensor work: the randomness and the filtered draw that
the engine's sampler (engine/sampling.py, whose docstring tells the scheme) and the plain-torch
models (the Qwen3-Omni talker's codes, models/qwen3_omni/talker_batch.py) share, so both draw
the same bits for the same (seed, position, lane) on the CPU and on any GPU.

A draw's row is one row of a table [R, COLUMNS] float64: the sampling settings, the request's
key (`seed_key` of its seed) and the position of what it draws.
"""

from __future__ import annotations

import secrets

import numpy as np
import torch

# The columns of a step's sampling table (float64: every integer below 2^53 is exact).
TEMPERATURE, TOP_K, TOP_P, MIN_P, KEY_LO, KEY_HI, POSITION = range(7)
COLUMNS = 7
LANES = 64  # uniforms a position may draw (lane < LANES); positions stay below 2^26
_M32 = 0xFFFF_FFFF
_M64 = 0xFFFF_FFFF_FFFF_FFFF


def request_seed(seed: int | None) -> int:
    """The 64-bit seed a request samples with: its own, else fresh entropy (unseeded requests
    differ run to run, as OpenAI's do)."""
    return secrets.randbits(64) if seed is None else seed & _M64


def seed_key(seed: int) -> tuple[float, float]:
    """The KEY_LO, KEY_HI columns of a 64-bit seed (splitmix64: nearby seeds, unrelated keys)."""
    z = (seed + 0x9E37_79B9_7F4A_7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & _M64
    z ^= z >> 31
    return float(z & _M32), float(z >> 32)


def step_table(rows: list[tuple[float, ...]]) -> torch.Tensor:  # [R, COLUMNS] float64 host
    """A step's table from each row's `sampling_row` + (position,) (through numpy: 2-3x faster
    than torch.tensor over a list of tuples)."""
    return torch.from_numpy(np.array(rows, dtype=np.float64).reshape(len(rows), COLUMNS))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit xorshift-multiply mixer (a bijection of [0, 2^32); hash-prospector's two-round
    constants). Both multipliers are under 2^31, so x * c < 2^63: int64 never wraps and every
    backend computes the same bits."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0_AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A_2D97) & _M32
    return x ^ (x >> 15)


def uniforms(table: torch.Tensor, lanes: torch.Tensor | int = 0) -> torch.Tensor:
    """[R, ...] float32 in [0, 1), 24 random bits each: the uniform of each row's (key,
    position, lane); `table` [R, COLUMNS] (on the device), `lanes` int or [R, ...] int64."""
    keys = table[:, KEY_LO : POSITION + 1].to(torch.int64)  # [R, 3]
    shape = (-1,) + (1,) * (lanes.dim() - 1) if isinstance(lanes, torch.Tensor) else (-1,)
    key_lo, key_hi, position = (keys[:, i].view(shape) for i in range(3))
    word = (position * LANES + lanes) & _M32
    bits = _mix32(_mix32(word ^ key_lo) ^ key_hi)
    return (bits >> 8).to(torch.float32) * (1.0 / (1 << 24))


def filtered_draw(
    scores: torch.Tensor,  # [N, V] float32 logits (masked entries -inf)
    settings: torch.Tensor,  # [N, 4] float: temperature (> 0), top_k (0: off), top_p, min_p
    uniform: torch.Tensor,  # [N] float32 in [0, 1)
) -> torch.Tensor:  # [N] int64
    """Temperature, then top-k, top-p, min-p over the sorted probabilities (the most likely
    token always kept), then the inverse CDF at `uniform` in vocabulary order."""
    vocab = scores.shape[-1]
    temperature, top_k, top_p, min_p = (settings[:, i : i + 1] for i in range(4))
    scaled = scores / torch.where(temperature > 0, temperature, 1.0).to(scores.dtype)
    sorted_scores, order = torch.sort(scaled, dim=-1, descending=True)  # [N, V]
    probs = sorted_scores.softmax(dim=-1)
    ranks = torch.arange(vocab, device=scores.device)  # [V]
    drop = ranks >= torch.where(top_k > 0, top_k, vocab).to(torch.int64)
    # top-p: drop a token when the tokens ranked above it already reach top_p
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p.to(probs.dtype)
    # min-p: drop tokens less likely than min_p x the most likely one
    drop |= probs < min_p.to(probs.dtype) * probs[:, :1]
    drop[:, 0] = False
    kept = torch.zeros_like(probs).scatter_(1, order, probs.masked_fill(drop, 0.0))
    cdf = kept.cumsum(dim=-1)  # [N, V] in vocabulary order
    target = (uniform.unsqueeze(1) * cdf[:, -1:]).to(cdf.dtype)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=vocab - 1)
