"""The sampler on hand-made logits: filters, determinism, the distribution it draws from, the
counter-based uniforms (sampling.py) against a plain-Python reference of the same hash."""

from __future__ import annotations

import pytest
import torch

from omni_server.engine.sampling import SamplingParams, greedy_tokens, sample, sampling_row
from omni_server.models.draws import (
    KEY_HI,
    KEY_LO,
    LANES,
    POSITION,
    request_seed,
    step_table,
    uniforms,
)

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]])  # argmax 5; probs ~ .59 .22 .08 ...


def _table(params: SamplingParams, positions: range, seed: int = 0) -> torch.Tensor:
    row = sampling_row(params, request_seed(seed))
    return step_table([(*row, p) for p in positions])


def _draws(params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    """n tokens of one request at positions 0..n-1, drawn in one batched call (a row's draw
    depends on its seed and position only, so this is n steps of the request)."""
    return sample(LOGITS.expand(n, -1), _table(params, range(n), seed))


def _chi_square(draws: list[int], expected: torch.Tensor) -> float:
    """Pearson's statistic of the draws' counts against `expected` probabilities (> 0 only)."""
    n = len(draws)
    counts = torch.bincount(torch.tensor(draws), minlength=len(expected)).double()
    support = expected > 0
    assert counts[~support].sum() == 0, "a token outside the support was drawn"
    e = expected[support].double() * n
    return float(((counts[support] - e) ** 2 / e).sum())


# chi-square quantiles at p = 0.999 (df = support size - 1): the draws are a fixed function of
# the seed, so these assertions are deterministic; a wrong distribution exceeds them by far
CHI2_999 = {1: 10.83, 2: 13.82, 5: 20.52, 63: 103.4}


def test_greedy_is_argmax() -> None:
    assert _draws(SamplingParams(temperature=0), 5) == [5] * 5


def test_greedy_takes_the_first_of_equal_maxima_as_argmax_does() -> None:
    # few distinct values over a SmolLM2-sized vocabulary: many ties in every row
    logits = torch.randint(0, 3, (16, 49152), generator=torch.Generator().manual_seed(0)).float()
    logits[3, 7] = float("nan")  # NaN wins, as in argmax
    tokens = greedy_tokens(logits)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert tokens[3] == 7 and tokens[0] == int((logits[0] == 2).nonzero()[0])


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=1), SamplingParams(top_p=0.05), SamplingParams(min_p=0.99)],
    ids=["top_k=1", "top_p=0.05", "min_p=0.99"],
)
def test_filters_that_leave_one_token_act_greedy(params: SamplingParams) -> None:
    assert _draws(params, 50) == [5] * 50


def test_frequencies_follow_softmax() -> None:
    draws = _draws(SamplingParams(temperature=1.0), 20000)
    assert _chi_square(draws, LOGITS[0].softmax(-1)) < CHI2_999[5]
    # and the test can fail: the same draws against a temperature-2 distribution
    assert _chi_square(draws, (LOGITS[0] / 2).softmax(-1)) > 10 * CHI2_999[5]


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        (SamplingParams(top_k=2), [5, 0]),
        # top_p 0.7: 5 (.59) alone is short of .7, so 0 (.22) joins; nothing else
        (SamplingParams(top_p=0.7), [5, 0]),
        # top_p 0.85: 5 + 0 = .81 < .85, so 1 (.08) joins
        (SamplingParams(top_p=0.85), [5, 0, 1]),
        # min_p 0.3: tokens with p >= .3 * .59 = .18 -> 5 and 0
        (SamplingParams(min_p=0.3), [5, 0]),
        (SamplingParams(temperature=0.5, top_k=3), [5, 0, 1]),
    ],
    ids=["top_k=2", "top_p=0.7", "top_p=0.85", "min_p=0.3", "t0.5_top_k=3"],
)
def test_truncated_distribution_is_the_renormalized_softmax(
    params: SamplingParams, kept: list[int]
) -> None:
    probs = (LOGITS[0] / params.temperature).softmax(-1)
    expected = torch.zeros_like(probs)
    expected[kept] = probs[kept] / probs[kept].sum()
    draws = _draws(params, 20000, seed=3)
    assert set(draws) == set(kept)  # the truncation is respected, every kept token reached
    assert _chi_square(draws, expected) < CHI2_999[len(kept) - 1]


def test_temperature_sharpens() -> None:
    cold = _draws(SamplingParams(temperature=0.2), 500)
    hot = _draws(SamplingParams(temperature=2.0), 500)
    assert cold.count(5) > hot.count(5)


def test_seed_reproducible_and_batch_independent() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    row = sampling_row(params, request_seed(42))
    alone = [sample(LOGITS, step_table([(*row, p)]))[0] for p in range(30)]
    assert alone == _draws(params, 30, seed=42)
    # the same request at row 1 of a batch beside a greedy row and a sampled unseeded one
    batch = torch.cat([LOGITS.flip(-1), LOGITS, LOGITS * 3])
    greedy = sampling_row(SamplingParams(temperature=0), request_seed(1))
    other = sampling_row(SamplingParams(temperature=0.5, top_k=3), request_seed(None))
    tables = [step_table([(*greedy, p), (*row, p), (*other, 7)]) for p in range(30)]
    in_batch = [sample(batch, table)[1] for table in tables]
    assert in_batch == alone
    assert _draws(params, 30, seed=43) != alone


def _reference_uniform(seed: int, position: int, lane: int) -> float:
    """sampling.py's uniform in plain Python integers (no int64 tensors to wrap)."""

    def mix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x21F0AAAD) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x735A2D97) & 0xFFFFFFFF
        return x ^ (x >> 15)

    m64 = (1 << 64) - 1
    z = (seed + 0x9E3779B97F4A7C15) & m64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m64
    z ^= z >> 31
    word = (position * LANES + lane) & 0xFFFFFFFF
    return (mix(mix(word ^ (z & 0xFFFFFFFF)) ^ (z >> 32)) >> 8) / (1 << 24)


def test_uniforms_equal_the_plain_integer_hash() -> None:
    gen = torch.Generator().manual_seed(0)
    seeds = [0, 1, 2**63 + 5, 2**64 - 1, *torch.randint(0, 2**62, (20,), generator=gen).tolist()]
    cases = [(s, p, lane) for s in seeds for p in (0, 1, 77, 2**20 + 3) for lane in (0, 9, 63)]
    table = step_table([(*sampling_row(SamplingParams(), s), p) for s, p, _ in cases])
    lanes = torch.tensor([lane for _, _, lane in cases])
    got = uniforms(table, lanes.view(-1)).tolist()
    assert table[:, POSITION].tolist() == [float(p) for _, p, _ in cases]
    assert table[:, KEY_LO].max() < 2**32 and table[:, KEY_HI].max() < 2**32
    assert got == [_reference_uniform(s, p, lane) for s, p, lane in cases]


def test_uniforms_are_uniform_across_positions_seeds_and_lanes() -> None:
    bins = 64

    def chi2(u: torch.Tensor) -> float:
        counts = torch.bincount((u * bins).long().flatten(), minlength=bins).double()
        e = u.numel() / bins
        return float(((counts - e) ** 2 / e).sum())

    row = sampling_row(SamplingParams(), 7)
    by_position = uniforms(step_table([(*row, p) for p in range(20000)]))
    by_seed = uniforms(step_table([(*sampling_row(SamplingParams(), s), 5) for s in range(20000)]))
    lanes = uniforms(
        step_table([(*row, p) for p in range(2000)]), torch.arange(16).expand(2000, 16)
    )
    for u in (by_position, by_seed, lanes):
        assert chi2(u) < CHI2_999[63]
    # neighbouring seeds and lanes are not correlated (|r| ~ 1/sqrt(n) for independent draws)
    pairs = torch.stack([by_seed[:-1], by_seed[1:]])
    assert abs(float(torch.corrcoef(pairs)[0, 1])) < 0.03
    assert abs(float(torch.corrcoef(lanes[:, :2].T)[0, 1])) < 0.08


def test_an_unseeded_request_gets_fresh_entropy() -> None:
    assert request_seed(5) == 5 and request_seed(-1) == 2**64 - 1
    assert len({request_seed(None) for _ in range(8)}) == 8


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1},
        {"temperature": float("nan")},
        {"top_p": 0},
        {"top_k": -1},
        {"min_p": 2},
        {"max_tokens": 0},
        {"stop": ("",)},
    ],
)
def test_invalid_params_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
