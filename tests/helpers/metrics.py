"""Reading the server's Prometheus text (`/metrics`) in tests: take `samples()` before and
after, compare one counter's `value()` (labels as keywords)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    """Every sample of the exposition, keyed by (name, sorted labels)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(metrics: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 when absent (a counter not yet incremented is not exported)."""
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)
