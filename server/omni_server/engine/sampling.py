"""Per-request sampling: greedy, temperature, top-k, top-p, min-p, with a seeded generator each.

Determinism: each sampled token consumes exactly one uniform number from the request's own
`torch.Generator` (inverse-CDF sampling over the filtered distribution in vocabulary order), and
every filter works row by row. So a seeded request draws the same tokens on every run, alone or
at any position of any batch. Generators live on the CPU (one draw per token is cheap; CUDA
generators could not be mixed in one batched call anyway); the filtering runs batched on the
model's device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


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


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    if seed is None:
        gen.seed()  # fresh entropy: unseeded requests differ run to run, as OpenAI's do
    else:
        gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


def sample(
    logits: torch.Tensor,  # [R, V] float32
    params: list[SamplingParams],  # one per row
    generators: list[torch.Generator],  # one per row (CPU)
    greedy: torch.Tensor | None = None,  # [R] greedy_tokens(logits), already computed
) -> list[int]:
    """One token per row. `greedy`: the rows' argmax as a decode graph computed it (the same
    argmax as greedy_tokens on CUDA), so no kernel runs here for a greedy batch."""
    # [R]: the greedy answer; sampled rows overwrite theirs
    tokens = greedy_tokens(logits) if greedy is None else greedy
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        if greedy is not None:
            tokens = tokens.clone()  # a graph's static output: not written here
        picked = _sample_rows(
            logits[rows], [params[i] for i in rows], [generators[i] for i in rows]
        )
        tokens[rows] = picked
    return tokens.tolist()


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] int64
    """argmax per row (the first of equal maxima). On the CPU through max(): its kernel is
    vectorized, argmax's a scalar loop (23 against 310 us over SmolLM2's 49152 logits, one
    thread); both return the first maximum's index, ties and NaN alike."""
    if logits.device.type == "cpu":
        return logits.max(dim=-1).indices
    return logits.argmax(dim=-1)


def _sample_rows(
    logits: torch.Tensor,  # [N, V]
    params: list[SamplingParams],
    generators: list[torch.Generator],
) -> torch.Tensor:  # [N] int64
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    sorted_logits, order = torch.sort(logits / temperature, dim=-1, descending=True)  # [N, V]
    probs = sorted_logits.softmax(dim=-1)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=device).unsqueeze(0)  # [1, V]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=device).unsqueeze(1)
    drop = ranks >= top_k
    # top-p: drop a token when the tokens ranked above it already reach top_p (keeps >= 1 token)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=probs.dtype)
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    # min-p: drop tokens less likely than min_p x the most likely one
    min_p = torch.tensor([p.min_p for p in params], device=device, dtype=probs.dtype)
    drop |= probs < (min_p * probs[:, 0]).unsqueeze(1)
    drop[:, 0] = False
    probs = probs.masked_fill(drop, 0.0)
    # Inverse CDF in vocabulary order, so the choice does not depend on how ties were sorted.
    kept = torch.zeros_like(probs).scatter_(1, order, probs)  # [N, V] in vocabulary order
    cdf = kept.cumsum(dim=-1)
    uniforms = torch.stack([torch.rand((), generator=g) for g in generators]).to(device)
    target = (uniforms * cdf[:, -1]).unsqueeze(1).to(cdf.dtype)  # [N, 1]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return picked.clamp_(max=vocab - 1)
