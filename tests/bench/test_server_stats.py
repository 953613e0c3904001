"""The per-level breakdown of our server's time, from a real Prometheus exposition."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from omni_bench.server_stats import breakdown, parse


def exposition(observations: dict[str, list[float]], ttfa: list[float]) -> str:
    registry = CollectorRegistry()
    queue = Histogram("omni_stage_queue_seconds", "q", ["stage"], registry=registry)
    compute = Histogram("omni_stage_compute_seconds", "c", ["stage"], registry=registry)
    first = Histogram("omni_time_to_first_audio_seconds", "t", ["model"], registry=registry)
    for stage, values in observations.items():
        for v in values:
            queue.labels(stage).observe(v / 10)
            compute.labels(stage).observe(v)
    for v in ttfa:
        first.labels("piper-joe").observe(v)
    return generate_latest(registry).decode()


def test_breakdown_is_the_mean_of_the_observations_between_two_scrapes():
    before = parse(exposition({"acoustic": [0.1, 0.3]}, [0.2]))
    after = parse(exposition({"acoustic": [0.1, 0.3, 0.5, 0.7], "encoder": [0.002]}, [0.2, 0.4]))
    got = breakdown(before, after)
    assert got["compute:acoustic"] == {"mean_ms": pytest.approx(600.0), "count": 2}
    assert got["queue:acoustic"]["mean_ms"] == pytest.approx(60.0)
    assert got["compute:encoder"]["mean_ms"] == pytest.approx(2.0)
    assert got["server_ttfa"] == {"mean_ms": pytest.approx(400.0), "count": 1}


def test_series_without_new_observations_are_left_out():
    text = exposition({"acoustic": [0.1]}, [0.2])
    assert breakdown(parse(text), parse(text)) == {}
    assert parse("# nothing of ours\nother_metric 1.0\n") == {}
