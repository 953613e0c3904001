"""Per-request sampling: greedy, temperature, top-k, top-p, min-p, batched over rows as tensors,
with counter-based seeded randomness.

A step samples its R rows from one table [R, COLUMNS] float64 (`step_table`): each row's settings
and random key (constants its request computed once: `sampling_row`) and the position of the
token it draws. The table crosses to the device in one copy; everything after it is tensor work
on the logits' device with no host state (`sample_on_device`: a CUDA graph can hold it) and the
host reads back the chosen ids, one tensor, at most.

Randomness is a pure function of (the request's seed, the position of the token drawn, a lane):
`uniforms` hashes them (the 64-bit seed turned into two 32-bit keys once, on the host, by
splitmix64; then two rounds of a 32-bit xorshift-multiply mixer over position * LANES + lane,
in int64 torch ops whose products stay under 2^63, so the CPU and every GPU compute the same
bits). So a
seeded request draws the same tokens on every run, alone or at any row of any batch, through
preemption and recompute (a token's position does not depend on when it is computed) and in a
step launched before its predecessor's tokens are read (overlap.py). An unseeded request gets a
fresh 64-bit seed when it enters the engine. A sampled token takes one uniform (lane 0; an audio
frame's codebook k lane k, its repetition-aware redraw lane K + k) and picks by inverse CDF over
the filtered distribution in vocabulary order, so the pick does not depend on how the sort
ordered ties. (Until 2026-12 each request drew from its own CPU torch.Generator: the tokens a
given seed yields changed then; the distribution did not.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from omni_server.models.draws import (
    MIN_P,
    TEMPERATURE,
    filtered_draw,
    seed_key,
    uniforms,
)


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler and the stop rules.

    temperature 0 means greedy (top_k / top_p / min_p / seed are then moot).
    max_tokens None means: up to the context window.
    """

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: decode exactly max_tokens tokens
    stop_token_ids: tuple[int, ...] = field(default=())
    # Audio-frame models: repetition-aware sampling (transformers' ras_win_len /
    # ras_win_max_num_repeat): a code already seen ras_max_repeat times in its codebook over
    # the last ras_window frames is redrawn from the unfiltered distribution. 0: off.
    ras_window: int = 0
    ras_max_repeat: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, int | float) and 0 <= self.temperature <= 100):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not math.isfinite(self.temperature):
            raise ValueError("temperature must be finite")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.min_p, int | float) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name in ("ras_window", "ras_max_repeat"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if (self.ras_window == 0) != (self.ras_max_repeat == 0):
            raise ValueError("ras_window and ras_max_repeat are set together (both 0: off)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_row(params: SamplingParams, seed: int) -> tuple[float, ...]:
    """A request's constant columns of the sampling table (all but POSITION), computed once."""
    settings = (params.temperature, params.top_k, params.top_p, params.min_p)
    return (*(float(x) for x in settings), *seed_key(seed))


def sample_on_device(
    logits: torch.Tensor,  # [R, V] float32
    table: torch.Tensor,  # [R, COLUMNS] on the logits' device
    greedy: torch.Tensor,  # [R] int64 each row's argmax
) -> torch.Tensor:  # [R] int64
    """One token a row, pure tensor work (no host state, no sync): a greedy row (temperature
    0) keeps its argmax; the others draw from their filtered distribution at lane 0."""
    settings = table[:, TEMPERATURE : MIN_P + 1].to(torch.float32)
    picked = filtered_draw(logits, settings, uniforms(table))
    return torch.where(settings[:, TEMPERATURE] > 0, picked, greedy)


def draw(
    logits: torch.Tensor,  # [R, V] float32
    table: torch.Tensor,  # [R, COLUMNS] float64 host (step_table)
    greedy: torch.Tensor | None = None,  # [R] greedy_tokens(logits), already computed
) -> torch.Tensor:  # [R] int64 on the logits' device, not read back
    """One token a row, left on the device. `greedy`: the rows' argmax as a decode graph
    computed it (the same argmax as greedy_tokens on CUDA), so a greedy batch runs no kernel
    here (the host table tells; no sync)."""
    tokens = greedy_tokens(logits) if greedy is None else greedy
    if not bool((table[:, TEMPERATURE] > 0).any()):
        return tokens
    device = logits.device
    return sample_on_device(logits, table.to(device, non_blocking=device.type == "cuda"), tokens)


def graph_draw(
    variant: object, logits: torch.Tensor, table: torch.Tensor, greedy: torch.Tensor
) -> torch.Tensor:
    """sample_on_device as draw_graphs.DrawGraphs captures it (a text head has one variant):
    the ~60 kernels of a sampled step's draw become one replay."""
    return sample_on_device(logits, table, greedy)


def sample(
    logits: torch.Tensor, table: torch.Tensor, greedy: torch.Tensor | None = None
) -> list[int]:
    """`draw`, read back: one token id a row."""
    return draw(logits, table, greedy).tolist()


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] int64
    """argmax per row (the first of equal maxima). On the CPU through max(): its kernel is
    vectorized, argmax's a scalar loop (23 against 310 us over SmolLM2's 49152 logits, one
    thread); both return the first maximum's index, ties and NaN alike."""
    if logits.device.type == "cpu":
        return logits.max(dim=-1).indices
    return logits.argmax(dim=-1)
