"""Markdown tables, target verdicts and plots from a synthetic result."""

from __future__ import annotations

from dataclasses import asdict

from omni_bench.metrics import LevelSummary
from omni_bench.report import markdown, verdicts, write_plots


def level(
    c: int, audio_sps: float, ttfa_p50: float, ttfa_p95: float, underrun_share: float = 0.0
) -> dict:
    pct = {"mean": 0.1, "p50": 0.1, "p95": 0.2, "p99": 0.3}
    return asdict(
        LevelSummary(
            concurrency=c, requests=10, failed=0, wall_seconds=1.0,
            requests_per_second=audio_sps / 4, audio_seconds_per_second=audio_sps,
            ttfa={"mean": ttfa_p50, "p50": ttfa_p50, "p95": ttfa_p95, "p99": ttfa_p95},
            latency=pct, rtf=pct, max_gap=pct, underrun=pct,
            underrun_share=underrun_share, worst_deficit=0.003 if underrun_share == 0 else 0.2,
        )
    )  # fmt: skip


def result(ours_thr_at_4: float, ours_ttfa_p95_at_16: float, late_at_16: float = 0.0) -> dict:
    wer = {"clips": 3, "corpus_wer": 0.03, "mean_clip_wer": 0.03, "p95_clip_wer": 0.1,
           "clips_above_half": 0, "worst": []}  # fmt: skip
    return {
        "machine": {"cpu": "test", "cores": 2, "platform": "linux", "python": "3.11",
                    "loadavg_at_start": [0.0, 0, 0], "loadavg_at_end": [0.0, 0, 0]},
        "command": "omni-bench speech",
        "settings": {"format": "pcm", "stream": True, "concurrency": [1, 4, 16],
                     "requests_per_level": 10, "dataset_texts": 10},
        "targets": [
            {"name": "omni-server", "wer": wer, "levels": [
                level(1, 30, 0.10, 0.12), level(4, ours_thr_at_4, 0.2, 0.3),
                level(16, 38, 0.3, ours_ttfa_p95_at_16, late_at_16)]},
            {"name": "in-process", "wer": {**wer, "corpus_wer": 0.025}, "levels": [
                level(1, 40, 0.09, 0.1), level(4, 40, 0.35, 0.4), level(16, 40, 1.4, 1.6)]},
        ],
    }  # fmt: skip


def test_verdicts_mark_each_target_met_or_missed():
    good = {v["target"]: v["met"] for v in verdicts(result(39.0, 0.2))}
    assert good == {
        "throughput at c=4 >= 0.95x in-process": True,
        "throughput at c=16 >= 0.95x in-process": True,
        "TTFA p50 at c=1 <= 1.2x first sentence": True,  # 100 ms vs 1.2 * 90 ms
        "TTFA p95 at c=16 <= 2.0x its c=1 value": True,  # 200 ms vs 2 * 120 ms
        "no stream underruns at c <= 16": True,
        "corpus WER no worse than in-process": True,  # 3.0% vs 2.5% + 1% tolerance
    }
    bad = {v["target"]: v["met"] for v in verdicts(result(30.0, 0.9, late_at_16=0.25))}
    assert bad["throughput at c=4 >= 0.95x in-process"] is False
    assert bad["TTFA p95 at c=16 <= 2.0x its c=1 value"] is False
    late = next(v for v in verdicts(result(39.0, 0.2, 0.25)) if "underruns" in v["target"])
    assert late["met"] is False and late["value"] == "c=16: 25%"


def test_markdown_has_a_row_per_level_and_the_ratios(tmp_path):
    text = markdown(result(39.0, 0.2))
    table = [row for row in text.splitlines() if row.count("|") == 20]  # the 19-column table
    rows = [row for row in table if row.startswith("| omni-server |")]
    assert len(rows) == 3
    assert "| 4 | 0.97x |" in text  # ours / in-process throughput at c=4
    assert "**missed**" not in text
    assert "**missed**" in markdown(result(30.0, 0.2))
    assert "| omni-server | 16 |" in text and "| 0% |" in text  # streams underrun at c=16


def test_plots_are_written_as_png(tmp_path):
    written = write_plots(result(39.0, 0.2), tmp_path)
    assert [p.name for p in written] == ["ttfa.png", "throughput.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
