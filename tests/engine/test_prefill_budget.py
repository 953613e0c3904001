"""Prefill sized by deadlines (engine/prefill_budget.py): a burst of new prompts beside playing
streams, run in a model of time.

The batcher is driven as the engine drives it, but every step's time is a synthetic affine
function of its cost units (SYNTHETIC: T(u) = FIXED_S + UNIT_S * u) and the clock advances by
it: deterministic, no wall clock. The assertions are the module's invariant (no started stream's
lead goes negative) and its bound (every new request's first frame within a stated number of
steps).
"""

from __future__ import annotations

import math

import pytest

from omni_server.engine import EngineConfig, GenerationRequest, SamplingParams
from omni_server.engine.batcher import Batcher, StepBatch
from omni_server.engine.kv_cache import BlockAllocator
from omni_server.engine.prefill_budget import StepTime, StepTimeFit, prefill_budget
from omni_server.engine.sequence import Sequence
from omni_server.engine.step_cost import StepCost

FRAME_S = 0.04  # a Higgs frame
MARGIN_S = 0.05
BLOCK = 16
FIXED_S, UNIT_S = 0.004, 0.0001  # the synthetic step: 4 ms + 0.1 ms a cost unit
SYNTHETIC = StepTime(FIXED_S, UNIT_S)


def _batcher(rows: int, *, playback_order: bool = True) -> Batcher:
    config = EngineConfig(
        max_total_tokens=4096 * BLOCK, max_batch_size=rows, max_step_tokens=1024,
        playback_order=playback_order,
    )  # fmt: skip
    # a GPU's batcher: no cap beside decodes but the step's own (engine.py's CUDA default)
    return Batcher(config, BlockAllocator(4096, BLOCK), StepCost(2000), 1024)


def _request(batcher: Batcher, name: str, prompt: int) -> Sequence:
    request = GenerationRequest(
        name, list(range(1, prompt + 1)), SamplingParams(max_tokens=10_000),
        playback_seconds=FRAME_S,
    )  # fmt: skip
    seq = Sequence(request, 10_000, None, arrival=len(batcher.running) + len(batcher.waiting))
    batcher.add(seq)
    return seq


def _units(batcher: Batcher, batch: StepBatch) -> float:
    cost = batcher.cost
    return sum(cost.decode(s.num_computed) for s in batch.decodes) + sum(
        cost.chunk(p.start, p.length) for p in batch.prefills
    )


def _step(batcher: Batcher, now: float) -> tuple[float, StepBatch, float]:
    """One step as the engine runs it, in the model of time: (the clock at its end, its batch,
    the smallest lead a started stream had at its end, before its frames came out)."""
    batch = batcher.next_batch(now, margin_s=MARGIN_S)
    assert batch is not None
    done = now + SYNTHETIC.seconds(_units(batcher, batch))
    leads = [s.playback.lead(done) for s in batcher.running if s.playback and s.playback.started]
    sampled = list(batch.decodes)
    for seq in batch.decodes:
        seq.num_computed += 1
    for work in batch.prefills:
        work.seq.num_computed += work.length
        if work.seq.num_computed == work.seq.num_tokens:
            sampled.append(work.seq)  # its prompt is done: its first frame comes out
    for seq in sampled:
        seq.token_ids.append(7)
        assert seq.playback is not None
        seq.playback.produced(FRAME_S, done)
    batcher.record_step(done - now, batch)
    return done, batch, min(leads, default=math.inf)


def _playing(batcher: Batcher, k: int, prompt: int = 32) -> float:
    """`k` streams started (their prompts in one step, then two steps of frames: the fit has
    seen both kinds, and each listener is ~0.1 s ahead); the clock."""
    for i in range(k):
        _request(batcher, f"playing{i}", prompt)
    now = 100.0
    for _ in range(3):
        now, _, _ = _step(batcher, now)
    return now


def _burst(batcher: Batcher, now: float, n: int, prompt: int) -> list[int]:
    """`n` new requests at once, stepped until each has its first frame; the step of each
    one's first frame (in arrival order), asserting after every step that no started stream's
    listener ran out."""
    new = [_request(batcher, f"new{i}", prompt) for i in range(n)]
    first_frame: dict[str, int] = {}
    for step in range(1, 2000):
        now, _, least_lead = _step(batcher, now)
        assert least_lead >= 0, f"a listener ran out at step {step}"
        for seq in new:
            if seq.playback is not None and seq.playback.started:
                first_frame.setdefault(seq.request_id, step)
        if len(first_frame) == n:
            return [first_frame[seq.request_id] for seq in new]
    raise AssertionError("the burst was never admitted")


@pytest.mark.parametrize(("k", "n", "prompt"), [(8, 24, 64), (32, 32, 48), (1, 40, 200)])
def test_a_burst_beside_playing_streams_never_runs_a_listener_dry(k, n, prompt):
    batcher = _batcher(rows=k + n)
    now = _playing(batcher, k)
    firsts = _burst(batcher, now, n, prompt)
    steps = max(firsts)
    # The stated bound (prefill_budget.py): between steps that advance the first prompt by a
    # block at least, at most W steps of decodes alone, W from every stream decoding.
    decode_units = (k + n) * batcher.cost.decode(prompt + steps)
    floor = batcher.cost.chunk(prompt, BLOCK)
    gain = FRAME_S - SYNTHETIC.seconds(decode_units)
    assert gain > 0  # the scenario is not an overload
    wait = math.ceil((MARGIN_S + SYNTHETIC.seconds(decode_units + floor)) / gain)
    blocks = math.ceil(prompt / BLOCK)  # advancing steps a prompt needs at most
    for i, step in enumerate(firsts):  # the i-th arrival waits on the i before it
        assert step <= (i + 1) * blocks * (wait + 1)
    # and the budget is the leads' slack, not the floor: more than a block a step on average
    assert steps < n * blocks


def test_the_same_burst_without_the_budget_runs_listeners_dry():
    """The scenario above is one the budget matters in: the plain batch (no playback order)
    fills the step with the burst's prefill and its listeners run out."""
    batcher = _batcher(rows=40, playback_order=False)
    now = _playing(batcher, 8)
    for i in range(32):
        _request(batcher, f"new{i}", 64)
    leads = []
    for _ in range(3):
        now, _, least = _step(batcher, now)
        leads.append(least)
    assert min(leads) < 0


def test_the_tightest_stream_bounds_the_step():
    budget = prefill_budget(
        leads=[(0.5, FRAME_S), (0.2, FRAME_S)], margin_s=MARGIN_S, decode_units=10,
        floor_units=16, ceiling_units=4096, time=SYNTHETIC,
    )  # fmt: skip
    assert SYNTHETIC.seconds(10 + budget) == pytest.approx(0.2 - MARGIN_S)
    assert budget == pytest.approx((0.2 - MARGIN_S - SYNTHETIC.seconds(10)) / UNIT_S)


def test_the_ceiling_caps_and_no_listener_or_no_measure_leaves_the_ceiling():
    common = {"margin_s": MARGIN_S, "decode_units": 10.0, "floor_units": 16.0}
    assert (
        prefill_budget(leads=[(60.0, FRAME_S)], ceiling_units=500, time=SYNTHETIC, **common) == 500
    )
    assert prefill_budget(leads=[], ceiling_units=500, time=SYNTHETIC, **common) == 500  # text
    assert prefill_budget(leads=[(0.0, FRAME_S)], ceiling_units=500, time=None, **common) == 500


def test_short_leads_hold_prompts_back_unless_decodes_alone_fall_behind():
    common = {"margin_s": MARGIN_S, "floor_units": 16.0, "ceiling_units": 500.0}
    # decodes alone take 5 ms a 40 ms frame: the leads grow, the prompts wait
    assert prefill_budget(leads=[(0.04, FRAME_S)], decode_units=10, time=SYNTHETIC, **common) == 0
    # decodes alone take 54 ms a 40 ms frame: an overload; a prompt still advances by its floor
    overloaded = prefill_budget(leads=[(0.04, FRAME_S)], decode_units=500, time=SYNTHETIC, **common)
    assert overloaded == 16.0


def test_the_fit_recovers_an_affine_step_time_and_is_proportional_without_spread():
    fit = StepTimeFit()
    assert fit.model() is None
    for units in (10, 300, 40, 700, 10):
        fit.record(units, SYNTHETIC.seconds(units))
    model = fit.model()
    assert model is not None
    assert model.fixed_s == pytest.approx(FIXED_S) and model.unit_s == pytest.approx(UNIT_S)
    same = StepTimeFit()
    for _ in range(5):
        same.record(20, SYNTHETIC.seconds(20))  # decodes only: fixed and per unit inseparable
    proportional = same.model()
    assert proportional is not None and proportional.fixed_s == 0
    # it over-estimates what prefill adds (errs to safety): 0.3 ms a unit against 0.1
    assert proportional.unit_s == pytest.approx(SYNTHETIC.seconds(20) / 20)
    assert proportional.unit_s > UNIT_S


def test_text_requests_batch_as_before_whatever_was_measured():
    batcher = _batcher(rows=4)
    batcher.step_time.record(10, 1.0)  # slow steps: a media stream would hold prompts back
    seq = Sequence(
        GenerationRequest("text", list(range(1, 200)), SamplingParams(max_tokens=4)),
        4, None, arrival=0,
    )  # fmt: skip
    batcher.add(seq)
    batch = batcher.next_batch(100.0, margin_s=MARGIN_S)
    assert batch is not None and [(p.seq.request_id, p.length) for p in batch.prefills] == [
        ("text", 199)
    ]
