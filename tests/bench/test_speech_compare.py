"""omni_bench.speech_compare: medians over rounds, ratios against the same run's floor, plot."""

from __future__ import annotations

import json

import pytest

from omni_bench.speech_compare import main, medians


def _run(ttfa_p95_c1: float, ttfa_p95_c16: float, ours: float, floor: float, load=1.0) -> dict:
    def level(c, p95, rate):
        return {
            "concurrency": c,
            "ttfa": {"p50": p95 / 2, "p95": p95},
            "audio_seconds_per_second": rate,
        }

    return {
        "machine": {"loadavg_at_start": [load, 0, 0]},
        "targets": [
            {
                "name": "omni-server",
                "levels": [level(1, ttfa_p95_c1, ours), level(16, ttfa_p95_c16, ours)],
            },
            {"name": "in-process", "levels": [level(1, 0.1, floor), level(16, 1.0, floor)]},
        ],
    }


def test_medians_take_each_metric_over_the_rounds_and_ratios_within_a_run():
    runs = [_run(0.1, 0.5, 10, 10), _run(0.2, 0.6, 9, 10), _run(0.1, 2.0, 20, 10)]
    got = medians(runs, 16)
    assert got["TTFA p95 ms"] == pytest.approx((600, 500, 2000))
    assert got["audio s/s"] == pytest.approx((10, 9, 20))
    assert got["vs floor"] == pytest.approx((1.0, 0.9, 2.0))
    # each run's own c=1 is the reference: 5x, 3x, 20x -> median 5x
    assert got["p95 / c=1 p95"] == pytest.approx((5.0, 3.0, 20.0))


def test_main_prints_a_table_per_variant_and_writes_the_plot(tmp_path, capsys):
    paths = {}
    for name, run in {"a1": _run(0.1, 0.5, 10, 10), "a2": _run(0.1, 0.7, 10, 10, 3.0),
                      "b1": _run(0.1, 0.3, 10, 10)}.items():  # fmt: skip
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(run))
    out = tmp_path / "ttfa.png"
    argv = [
        f"--run=before={paths['a1']}",
        f"--run=before={paths['a2']}",
        f"--run=after={paths['b1']}",
    ]
    assert main([*argv, "--plot", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| before | 2 | 16 | 300 (250-350) | 600 (500-700) |" in text
    assert "| after | 1 | 16 | 150 | 300 |" in text
    assert "before: 1.0-3.0" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_bad_run_argument_is_a_usage_error(capsys):
    assert main(["--run", "no-label"]) == 2
    assert "LABEL=path/to/speech.json" in capsys.readouterr().err


def test_steady_ttfa_leaves_out_the_first_concurrency_requests_sent():
    """The first c requests of a level start together (a burst); ttfa_steady is the rest."""
    from omni_bench.metrics import Chunk, RequestTiming, summarize

    def timing(start: float, ttfa: float) -> RequestTiming:
        return RequestTiming("t", start, start + 1, [Chunk(start + ttfa, 10)], 1.0)

    burst = [timing(0.0, 0.9), timing(0.0, 0.8)]
    later = [timing(1.0, 0.1), timing(1.5, 0.2), timing(2.0, 0.3)]
    level = summarize(2, [later[2], burst[0], later[0], burst[1], later[1]], wall=3.0)
    assert level.ttfa["p50"] == pytest.approx(0.3)  # all five
    assert level.ttfa_steady["p50"] == pytest.approx(0.2)  # the three sent after the burst
    assert level.ttfa_steady["mean"] == pytest.approx(0.2)


def test_serve_args_need_serve_and_must_parse(capsys):
    from omni_bench.speech import main as speech

    assert speech(["--url", "http://127.0.0.1:9", "--serve-args", "--max-in-flight 32"]) == 2
    assert "--serve-args needs --serve" in capsys.readouterr().err
    assert speech(["--serve", "--serve-args", "--stages.x 'unclosed"]) == 2
    assert "No closing quotation" in capsys.readouterr().err
