"""Playback-aware order of a stream stage whose chunks are media (stage/scheduling/stream_order.py).

The clock is passed in (`now`), so every assertion is about order, never about elapsed time.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from omni_server.stage.scheduling import WorkItem
from omni_server.stage.scheduling.calls import BackendContractError, StageCalls
from omni_server.stage.scheduling.stream import ActiveRequest, pick
from omni_server.stage.scheduling.stream_order import MARGIN_FLOOR_S, Playback, StepClock, rank


class _Stream:
    def __init__(self, ready: bool = True, drained: bool = False) -> None:
        self.ready, self.drained = ready, drained


def _stream_at(key: int, *, first_at: float | None, seconds: float, drained: bool = False):
    """A request with stream input whose listener started at `first_at` (None: no chunk yet)
    and has been sent `seconds` of audio since."""
    env = SimpleNamespace(key=key)
    item = WorkItem(env=env, request=None, timings=[], stream=_Stream(drained=drained))  # type: ignore[arg-type]
    playback = Playback(first_at=first_at, seconds=seconds)
    return ActiveRequest(item, chunks=0 if first_at is None else 3, playback=playback)


def _order(admitted: list[ActiveRequest], now: float, margin: float) -> list[int]:
    order = []
    while (active := pick(admitted, now, margin)) is not None:
        order.append(active.item.key)
        admitted.remove(active)
    return order


def test_a_stream_far_ahead_yields_to_a_new_request_and_to_one_about_to_run_dry():
    now, margin = 100.0, 0.3
    admitted = [  # admission order: the oldest first
        _stream_at(1, first_at=90.0, seconds=20.0),  # lead 10 s
        _stream_at(2, first_at=95.0, seconds=5.2),  # lead 0.2 s: below the margin
        _stream_at(3, first_at=None, seconds=0.0),  # a new request: its first chunk
        _stream_at(4, first_at=98.0, seconds=3.0),  # lead 1 s
        _stream_at(5, first_at=99.0, seconds=1.0, drained=True),  # input all read, lead 0
        _stream_at(6, first_at=97.0, seconds=2.0),  # lead -1 s: already late
    ]
    # urgent ones first, earliest deadline first (5 is finishing, but its listener has nothing
    # left: urgency comes before finishing); then the first chunk; then by deadline
    assert _order(admitted, now, margin) == [6, 5, 2, 3, 4, 1]


def test_streams_ahead_of_their_listeners_run_earliest_deadline_first():
    now, margin = 50.0, 0.1
    admitted = [
        _stream_at(1, first_at=40.0, seconds=15.0),  # deadline 55
        _stream_at(2, first_at=45.0, seconds=7.0),  # deadline 52
        _stream_at(3, first_at=49.0, seconds=4.0, drained=True),  # finishing, deadline 53
        _stream_at(4, first_at=48.0, seconds=6.0),  # deadline 54
    ]
    assert _order(admitted, now, margin) == [3, 2, 4, 1]  # finishing ones right after first


def test_a_waiting_stream_becomes_urgent_as_time_passes_so_none_starves():
    ahead = _stream_at(1, first_at=0.0, seconds=5.0)  # deadline 5
    new = _stream_at(2, first_at=None, seconds=0.0)
    assert pick([ahead, new], now=1.0, margin_s=0.5) is new
    assert pick([ahead, new], now=4.6, margin_s=0.5) is ahead  # 0.4 s left: before any first


def test_without_playback_seconds_the_order_is_fewest_chunks_first():
    def plain(key: int, chunks: int) -> ActiveRequest:
        item = WorkItem(env=SimpleNamespace(key=key), request=None, timings=[], stream=_Stream())  # type: ignore[arg-type]
        return ActiveRequest(item, chunks=chunks)

    assert _order([plain(1, 4), plain(2, 2), plain(3, 0)], now=0.0, margin=1.0) == [3, 2, 1]
    assert rank(2, False, None, 0.0, 1.0) < rank(4, False, None, 0.0, 1.0)


def test_the_listener_starts_at_the_first_chunk_and_the_smallest_lead_is_kept():
    playback = Playback()
    assert not playback.started and playback.deadline() == math.inf
    playback.produced(2.0, now=10.0)  # first chunk: 2 s of audio, the listener starts
    assert playback.deadline() == 12.0 and playback.min_lead == math.inf
    playback.produced(1.0, now=11.5)  # 0.5 s of audio left when it came out
    playback.produced(1.0, now=13.2)  # 0.2 s late: the listener ran dry
    assert playback.min_lead == pytest.approx(-0.2)
    assert playback.lead(13.2) == pytest.approx(0.8)


def test_the_margin_follows_the_step_time_above_a_floor():
    clock = StepClock()
    assert clock.margin_s == MARGIN_FLOOR_S  # nothing measured yet
    clock.record(0.4)
    assert clock.margin_s == pytest.approx(0.8)
    for _ in range(50):
        clock.record(0.001)
    assert clock.margin_s == MARGIN_FLOOR_S


class _Backend:
    def __init__(self, answer):
        self.answer = answer

    def playback_seconds(self, chunk):
        return self.answer


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan, "1", True])
def test_a_backend_that_says_nonsense_about_a_chunk_breaks_the_contract(bad):
    calls = StageCalls(SimpleNamespace(route=None, merge=None), _Backend(bad))  # type: ignore[arg-type]
    assert calls.plays_media
    with pytest.raises(BackendContractError, match="playback_seconds"):
        calls.playback_seconds({})


def test_none_counts_as_no_media_and_a_backend_without_the_method_plays_none():
    calls = StageCalls(SimpleNamespace(route=None, merge=None), _Backend(None))  # type: ignore[arg-type]
    assert calls.playback_seconds({}) == 0.0
    plain = StageCalls(SimpleNamespace(route=None, merge=None), object())  # type: ignore[arg-type]
    assert not plain.plays_media
