"""Where a level's time went inside our server: deltas of its Prometheus histograms.

The bench scrapes `/metrics` before and after each level and subtracts: per stage, the mean
time a request waited in the stage's inbox (`omni_stage_queue_seconds`) and the mean backend
time a stage spent on a request (`omni_stage_compute_seconds`), and the server's own time to
first audio (`omni_time_to_first_audio_seconds`: request received -> first audio ready). Set
beside the client's TTFA this splits a slow first byte into queueing, compute and the HTTP path.
A server without `/metrics` simply gets no breakdown.
"""

from __future__ import annotations

from collections import defaultdict

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

# histogram name -> the label that tells its series apart ("" for one series)
HISTOGRAMS = {
    "omni_stage_queue_seconds": "stage",
    "omni_stage_compute_seconds": "stage",
    "omni_time_to_first_audio_seconds": "",
}

Snapshot = dict[tuple[str, str], list[float]]  # (histogram, label value) -> [sum, count]


def parse(text: str) -> Snapshot:
    """Sums and counts of the histograms above from a Prometheus text exposition."""
    out: Snapshot = defaultdict(lambda: [0.0, 0.0])
    for family in text_string_to_metric_families(text):
        if family.name not in HISTOGRAMS:
            continue
        label = HISTOGRAMS[family.name]
        for sample in family.samples:
            key = (family.name, sample.labels.get(label, "") if label else "")
            if sample.name == f"{family.name}_sum":
                out[key][0] += sample.value
            elif sample.name == f"{family.name}_count":
                out[key][1] += sample.value
    return dict(out)


async def scrape(session: aiohttp.ClientSession, url: str) -> Snapshot | None:
    """One snapshot, or None when the server exposes no metrics."""
    try:
        async with session.get(f"{url}/metrics") as response:
            if response.status != 200:
                return None
            return parse(await response.text())
    except aiohttp.ClientError:
        return None


def breakdown(before: Snapshot, after: Snapshot) -> dict[str, dict[str, float]]:
    """Per series, the mean over the level's requests in milliseconds, and how many there were:
    {"queue:acoustic": {"mean_ms": .., "count": ..}, "compute:acoustic": .., "server_ttfa": ..}."""
    names = {
        "omni_stage_queue_seconds": "queue",
        "omni_stage_compute_seconds": "compute",
        "omni_time_to_first_audio_seconds": "server_ttfa",
    }
    out = {}
    for key, (total, count) in after.items():
        old_total, old_count = before.get(key, (0.0, 0.0))
        n = count - old_count
        if n <= 0:
            continue
        histogram, label = key
        name = names[histogram] + (f":{label}" if label else "")
        out[name] = {"mean_ms": 1000 * (total - old_total) / n, "count": n}
    return out
