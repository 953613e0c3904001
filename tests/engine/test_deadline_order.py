"""Playback-aware batches (engine/deadline_order.py): which requests the next step holds when it
cannot hold everyone, for requests of given leads.

The batcher is driven directly with requests placed in the state a test needs (running with
their prompt computed, a listener that started at `first_at` and was sent `seconds` of audio)
and the clock passed in (`now`): every assertion is about the choice, never about elapsed time.
"""

from __future__ import annotations

import math

import pytest

from omni_server.engine import EngineConfig, GenerationRequest, SamplingParams
from omni_server.engine.batcher import Batcher, StepBatch
from omni_server.engine.deadline_order import SLACK_S, rank
from omni_server.engine.kv_cache import BlockAllocator
from omni_server.engine.sequence import Sequence, Status
from omni_server.engine.step_cost import StepCost
from omni_server.playback import MARGIN_FLOOR_S, Playback

NOW = 100.0
FRAME_S = 0.04  # a Higgs frame


def _batcher(
    max_batch_size: int = 2, max_step_tokens: int = 64, num_blocks: int = 64, beside: int = 8
) -> Batcher:
    config = EngineConfig(
        max_total_tokens=num_blocks * 16, max_batch_size=max_batch_size,
        max_step_tokens=max_step_tokens,
    )  # fmt: skip
    # keys huge: a token costs 1 whatever its context, so budgets read as token counts
    return Batcher(config, BlockAllocator(num_blocks, 16), StepCost(10**9), beside)


def _request(
    batcher: Batcher, name: str, prompt: int, *, media: bool = True, lead: float | None = None
) -> Sequence:
    """A request in `batcher`: waiting (lead None: no frame yet), or running with its prompt
    computed and `lead` seconds of audio beyond a listener that started 5 s ago."""
    request = GenerationRequest(
        name, list(range(1, prompt + 1)), SamplingParams(max_tokens=1000),
        playback_seconds=FRAME_S if media else None,
    )  # fmt: skip
    seq = Sequence(request, 1000, None, arrival=len(batcher.running) + len(batcher.waiting))
    if lead is None:
        batcher.add(seq)
        return seq
    batcher.admit(seq)  # KV for its prompt, computed; its first output is a decode at `prompt`
    seq.num_computed = prompt
    seq.token_ids.append(7)
    if seq.playback is not None:
        seq.playback.first_at = NOW - 5.0
        seq.playback.seconds = 5.0 + lead
    return seq


def _names(batch: StepBatch | None) -> tuple[list[str], list[tuple[str, int]]]:
    assert batch is not None
    return (
        [s.request_id for s in batch.decodes],
        [(p.seq.request_id, p.length) for p in batch.prefills],
    )


def test_a_new_request_takes_the_row_of_the_stream_furthest_ahead():
    batcher = _batcher(max_batch_size=2)
    _request(batcher, "far", 8, lead=6.0)
    _request(batcher, "near", 8, lead=2.0)
    _request(batcher, "new", 20)
    decodes, prefills = _names(batcher.next_batch(NOW, margin_s=0.1))
    # the batch is full (2 rows): the new prompt's prefill goes first, whole (every stream
    # left in the step has lead, so no cap beside decodes), then the smallest lead
    assert prefills == [("new", 20)] and decodes == ["near"]
    assert len(batcher.running) == 3  # "far" keeps its KV: it only sits out


def test_without_playback_a_full_batch_keeps_its_requests_and_the_new_one_waits():
    batcher = _batcher(max_batch_size=2)
    _request(batcher, "a", 8, media=False, lead=6.0)
    _request(batcher, "b", 8, media=False, lead=2.0)
    _request(batcher, "new", 20, media=False)
    decodes, prefills = _names(batcher.next_batch(NOW, margin_s=0.1))
    assert decodes == ["a", "b"] and prefills == []  # the plain order: as before this change
    assert [s.request_id for s in batcher.waiting] == ["new"]


def test_urgent_streams_step_first_and_cap_the_prefill_beside_them():
    batcher = _batcher(max_batch_size=3, beside=8)
    _request(batcher, "far", 8, lead=4.0)
    _request(batcher, "dry", 8, lead=0.02)  # under the margin: its listener runs dry next
    _request(batcher, "new", 30)
    decodes, prefills = _names(batcher.next_batch(NOW, margin_s=0.1))
    assert decodes[0] == "dry"
    # beside an urgent decode the prompt gets the plain batch's share (8 tokens; a chunk is at
    # least a block of 16); "far" comes last, in what the budget leaves
    assert prefills == [("new", 16)] and decodes == ["dry", "far"]


@pytest.mark.parametrize(("lead", "chunk"), [(6.0, 60), (0.3, 19)])
def test_a_prefill_stretches_the_step_only_as_far_as_the_tightest_lead_allows(lead, chunk):
    """No started stream gets a frame before the step ends: with a cost unit measured at
    10 ms, a stream 0.3 s ahead (margin 0.1 s) lets the step take 20 units, one 6 s ahead
    all of the prompt."""
    batcher = _batcher(max_batch_size=2, max_step_tokens=64, beside=8)
    batcher.step_time.record(1.0, 0.01)  # a cost unit measured at 10 ms (proportional)
    _request(batcher, "ahead", 8, lead=lead)
    _request(batcher, "new", 60)
    [(name, length)] = _names(batcher.next_batch(NOW, margin_s=0.1))[1]
    assert name == "new" and abs(length - chunk) <= 1  # (0.3 - 0.1) / 0.01, give or take a ulp


def test_the_engine_measures_what_a_cost_unit_takes():
    batcher = _batcher()
    seq = _request(batcher, "a", 8, lead=1.0)
    seq.num_computed += 1  # the engine advanced it, then records the step
    batcher.record_step(0.2, StepBatch([seq], []))
    model = batcher.step_time.model()  # one decode: one unit (keys are huge here)
    assert model is not None and model.seconds(1.0) == pytest.approx(0.2)
    assert batcher.steps.margin_s == pytest.approx(0.4)


def test_late_streams_go_earliest_deadline_first_and_before_new_requests():
    batcher = _batcher(max_batch_size=2)
    _request(batcher, "ok", 8, lead=3.0)
    _request(batcher, "late", 8, lead=-0.5)  # already behind its listener
    _request(batcher, "later", 8, lead=-0.2)
    _request(batcher, "new", 8)
    decodes, prefills = _names(batcher.next_batch(NOW, margin_s=0.1))
    assert decodes == ["late", "later"] and prefills == []  # two rows, both urgent


def test_a_stream_that_sits_out_is_served_once_its_lead_falls_under_the_margin():
    """Nothing starves: a stream with lead yields steps, its lead shrinks with time, and at
    the margin it outranks the new request it yielded to."""
    batcher = _batcher(max_batch_size=1)
    ahead = _request(batcher, "ahead", 8, lead=2.0)
    new = _request(batcher, "new", 40)
    assert rank(new, NOW, 0.1) < rank(ahead, NOW, 0.1)
    assert _names(batcher.next_batch(NOW, margin_s=0.1)) == ([], [("new", 40)])
    later = NOW + 1.95  # its lead is 0.05 s now: urgent
    assert rank(ahead, later, 0.1) < rank(new, later, 0.1)
    new.token_ids.append(3)  # the prompt was computed and sampled (as the engine would)
    new.num_computed = 40
    assert _names(batcher.next_batch(later, margin_s=0.1)) == (["ahead"], [])


def test_when_everyone_fits_every_request_steps_together():
    batcher = _batcher(max_batch_size=4, max_step_tokens=64, beside=32)
    _request(batcher, "far", 8, lead=6.0)
    _request(batcher, "near", 8, lead=0.01)
    _request(batcher, "new", 16)
    decodes, prefills = _names(batcher.next_batch(NOW, margin_s=0.1))
    assert sorted(decodes) == ["far", "near"] and prefills == [("new", 16)]


def test_admission_past_max_batch_size_stops_when_too_few_streams_have_lead_to_give():
    batcher = _batcher(max_batch_size=2)
    _request(batcher, "far", 8, lead=6.0)
    _request(batcher, "close", 8, lead=SLACK_S / 2)
    first = _request(batcher, "first", 20)
    second = _request(batcher, "second", 20)
    decodes, prefills = _names(batcher.next_batch(NOW, margin_s=0.1))
    # "first" is admitted (one running stream is far ahead); then "close" and "first" make two
    # without slack: "second" waits for a row, though budget is left
    assert prefills == [("first", 20)] and decodes == ["close"]
    assert first.status is Status.RUNNING and second.status is Status.WAITING


def test_kv_pressure_preempts_the_stream_furthest_ahead_not_the_newest():
    batcher = _batcher(max_batch_size=4, num_blocks=3)  # three blocks of 16 tokens
    _request(batcher, "far", 15, lead=5.0)  # oldest: the plain batcher would keep it
    edge = _request(batcher, "edge", 16, lead=0.02)  # its next token needs a new block
    new = _request(batcher, "new", 10, lead=0.0)
    new.playback = Playback()  # its prompt computed, its first frame not out yet: a new request
    decodes, _ = _names(batcher.next_batch(NOW, margin_s=0.1))
    assert decodes == ["edge", "new"]
    assert [s.request_id for s in batcher.waiting] == ["far"] and batcher.num_preemptions == 1
    assert len(edge.block_table) == 2


@pytest.mark.parametrize("bad", [0.0, -0.04, math.inf, math.nan, True, "0.04"])
def test_playback_seconds_must_be_positive(bad, make_tiny_engine):
    engine = make_tiny_engine()
    with pytest.raises(ValueError, match="playback_seconds"):
        engine.add(GenerationRequest("r", [1, 2], SamplingParams(), playback_seconds=bad))


def test_the_margin_is_the_step_clocks():
    batcher = _batcher()
    assert batcher.steps.margin_s == MARGIN_FLOOR_S
    batcher.steps.record(0.2)
    assert batcher.steps.margin_s == pytest.approx(0.4)


def test_playback_order_false_keeps_the_plain_order_for_media_requests():
    batcher = _batcher(max_batch_size=2)
    batcher.config = EngineConfig(max_total_tokens=1024, max_batch_size=2, playback_order=False)
    _request(batcher, "far", 8, lead=6.0)
    _request(batcher, "near", 8, lead=2.0)
    _request(batcher, "new", 20)
    assert _names(batcher.next_batch(NOW, margin_s=0.1)) == (["far", "near"], [])
    with pytest.raises(ValueError, match=r"engine\.playback_order must be true or false"):
        EngineConfig.from_table({"playback_order": "no"})
