"""The sampler on hand-made logits: filters, determinism, the distribution it draws from."""

from __future__ import annotations

import pytest
import torch

from omni_server.engine.sampling import SamplingParams, greedy_tokens, make_generator, sample

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]])  # argmax 5; probs ~ .59 .22 .08 ...


def _draws(params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    gen = make_generator(seed)
    return [sample(LOGITS, [params], [gen])[0] for _ in range(n)]


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


def test_top_k_and_top_p_restrict_the_support() -> None:
    assert set(_draws(SamplingParams(top_k=2), 300)) == {5, 0}
    # top_p 0.7: 5 (.59) alone is short of .7, so 0 (.22) joins; nothing else
    assert set(_draws(SamplingParams(top_p=0.7), 300)) == {5, 0}
    # min_p 0.3: tokens with p >= .3 * .59 = .18 -> 5 and 0
    assert set(_draws(SamplingParams(min_p=0.3), 300)) == {5, 0}


def test_frequencies_follow_softmax() -> None:
    n = 4000
    draws = torch.tensor(_draws(SamplingParams(temperature=1.0), n))
    freq = torch.bincount(draws, minlength=6).float() / n
    expected = LOGITS[0].softmax(-1)
    assert (freq - expected).abs().max().item() < 0.03  # ~4 standard errors at n=4000


def test_temperature_sharpens() -> None:
    cold = _draws(SamplingParams(temperature=0.2), 500)
    hot = _draws(SamplingParams(temperature=2.0), 500)
    assert cold.count(5) > hot.count(5)


def test_seed_reproducible_and_row_independent() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    alone = _draws(params, 30, seed=42)
    again = _draws(params, 30, seed=42)
    assert alone == again
    # the same seeded row inside a batch, beside rows with other params and generators
    batch = torch.cat([LOGITS.flip(-1), LOGITS, LOGITS * 3])
    gens = [make_generator(1), make_generator(42), make_generator(None)]
    rows = [SamplingParams(temperature=0), params, SamplingParams(temperature=0.5, top_k=3)]
    in_batch = [sample(batch, rows, gens)[1] for _ in range(30)]
    assert in_batch == alone
    assert _draws(params, 30, seed=43) != alone


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
