"""The speech metrics on synthetic timings (no clock involved)."""

from __future__ import annotations

import math

import pytest

from omni_bench.metrics import (
    Chunk,
    RequestTiming,
    inter_chunk_gaps,
    latency,
    percentiles,
    playback_underrun,
    rtf,
    summarize,
    ttfa,
)

BYTES_PER_SECOND = 48_000  # s16le mono at 24 kHz


def timing(start: float, chunks: list[tuple[float, float]], end: float | None = None, **kw):
    """A request sent at `start` whose chunks arrive at (time, audio seconds)."""
    t = RequestTiming(text="x", start=start, **kw)
    t.chunks = [Chunk(at, int(sec * BYTES_PER_SECOND)) for at, sec in chunks]
    t.end = end if end is not None else chunks[-1][0]
    t.audio_seconds = sum(sec for _, sec in chunks)
    return t


def test_ttfa_is_send_to_first_chunk():
    t = timing(10.0, [(10.25, 1.0), (10.9, 2.0)])
    assert ttfa(t) == pytest.approx(0.25)
    assert latency(t) == pytest.approx(0.9)


def test_ttfa_of_an_empty_body_is_an_error():
    t = RequestTiming(text="hello", start=0.0, end=1.0)
    with pytest.raises(ValueError, match="no body"):
        ttfa(t)


def test_rtf_is_latency_over_audio_seconds():
    t = timing(0.0, [(0.1, 2.0), (0.5, 2.0)])
    assert rtf(t) == pytest.approx(0.5 / 4.0)
    silent = timing(0.0, [(0.1, 0.0)])
    with pytest.raises(ValueError, match="no audio"):
        rtf(silent)


def test_inter_chunk_gaps():
    t = timing(0.0, [(0.1, 1.0), (0.4, 1.0), (0.45, 1.0)])
    assert inter_chunk_gaps(t) == pytest.approx([0.3, 0.05])
    assert inter_chunk_gaps(timing(0.0, [(0.2, 1.0)])) == []


def test_no_underrun_when_each_chunk_arrives_before_playback_needs_it():
    # 1 s of audio at 0.1, the next second arrives 0.5 s into playback: always ahead.
    t = timing(0.0, [(0.1, 1.0), (0.6, 1.0), (1.5, 1.0)])
    assert playback_underrun(t) == 0.0


def test_underrun_is_the_worst_shortfall_of_a_listener_starting_at_first_byte():
    # Chunk 0 (0.5 s of audio) at t=1; chunk 1 at t=2.5 -> playback needed 1.5 s, had 0.5 s:
    # short by 1.0 s. Chunk 2 at t=3.0 -> needed 2.0 s, had 0.5 + 2.0 = 2.5 s: fine.
    t = timing(0.0, [(1.0, 0.5), (2.5, 2.0), (3.0, 1.0)])
    assert playback_underrun(t) == pytest.approx(1.0)


def test_underrun_of_a_single_chunk_response_is_zero():
    assert playback_underrun(timing(0.0, [(0.7, 3.0)])) == 0.0


def test_underrun_spreads_audio_by_bytes_for_split_chunks():
    # The same 2 s clip delivered as four equal byte chunks 0.6 s apart: every chunk holds 0.5 s,
    # so the k-th arrives at 0.6k with 0.5k s buffered -> worst shortfall 0.1 * 3 = 0.3 s.
    t = timing(0.0, [(0.0, 0.5), (0.6, 0.5), (1.2, 0.5), (1.8, 0.5)])
    assert playback_underrun(t) == pytest.approx(0.3)


def test_percentiles():
    values = list(range(1, 101))  # 1..100
    p = percentiles(values)
    assert p["p50"] == pytest.approx(50.5)
    assert p["p95"] == pytest.approx(95.05)
    assert p["p99"] == pytest.approx(99.01)
    assert p["mean"] == pytest.approx(50.5)
    empty = percentiles([])
    assert all(math.isnan(v) for v in empty.values())


def test_summarize_counts_failures_and_throughput_over_wall_time():
    ok = [timing(0.0, [(0.1, 2.0)]), timing(0.0, [(0.2, 3.0), (0.4, 1.0)])]
    bad = RequestTiming(text="y", start=0.0, end=0.3, error="HTTP 500: boom")
    level = summarize(2, [*ok, bad], wall=2.0)
    assert level.requests == 3
    assert level.failed == 1
    assert level.requests_per_second == pytest.approx(1.0)
    assert level.audio_seconds_per_second == pytest.approx(3.0)
    assert level.ttfa["p50"] == pytest.approx(0.15)
    assert level.max_gap["p50"] == pytest.approx(0.1)
    assert level.errors == ["HTTP 500: boom"]


def test_the_share_of_streams_that_underrun_and_the_worst_deficit():
    on_time = timing(0.0, [(0.1, 1.0), (0.6, 1.0)])  # 0.5 s after the first, 1 s was playing
    late = timing(0.0, [(0.1, 0.5), (0.9, 1.0)])  # 0.8 s after the first, only 0.5 s had come
    jitter = timing(0.0, [(0.1, 0.5), (0.603, 1.0)])  # 3 ms short: within the tolerance
    level = summarize(3, [on_time, late, jitter], wall=1.0)
    assert level.underrun_share == pytest.approx(1 / 3)
    assert level.worst_deficit == pytest.approx(0.3)


def test_an_open_loop_level_records_its_rate():
    level = summarize(0, [timing(0.0, [(0.1, 1.0)])], wall=1.0, rate=2.5)
    assert level.rate == 2.5 and level.underrun_share == 0.0
