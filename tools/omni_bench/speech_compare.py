"""Compare `omni-bench speech` runs of several server variants: a markdown table and a plot.

    python -m omni_bench.speech_compare --run before=r1-before/speech.json \\
        --run before=r2-before/speech.json --run after=r1-after/speech.json ... \\
        --plot docs/img/voice-ttfa.png

Each `--run LABEL=FILE` is one speech.json (a run of our server with the in-process floor
measured alongside). Runs sharing a label are rounds of one variant: the table gives, per
concurrency, the median over rounds of each metric (TTFA p50 / p95, audio s/s, throughput
against the floor of the same run, TTFA p95 against the same run's c=1 p95; "steady": the
requests sent after the level's first c, which all start at once), and the range over rounds.
On a shared machine one run is noise; medians of interleaved rounds are the claim.
The plot draws the medians' TTFA p50 (solid), p95 (dashed) and steady p95 (dotted) against
concurrency.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from omni_bench.harness import plots, tables
from omni_bench.report import FLOOR, OURS


def load_runs(pairs: list[str]) -> dict[str, list[dict]]:
    """LABEL=FILE pairs -> label -> its runs' result dicts, labels in first-seen order."""
    runs: dict[str, list[dict]] = {}
    for pair in pairs:
        label, sep, file = pair.partition("=")
        if not sep or not label or not file:
            raise ValueError(f"--run {pair!r}: expected LABEL=path/to/speech.json")
        runs.setdefault(label, []).append(json.loads(Path(file).read_text()))
    return runs


def _levels(result: dict, target: str) -> dict[int, dict]:
    for t in result["targets"]:
        if t["name"] == target:
            return {x["concurrency"]: x for x in t["levels"]}
    raise ValueError(f"a run has no target {target!r}")


Metric = Callable[[dict, int], float]


def _ttfa(quantile: str) -> Metric:
    return lambda run, c: _levels(run, OURS)[c]["ttfa"][quantile] * 1000


def _steady_p95(run: dict, c: int) -> float:
    """TTFA p95 of the requests after the level's first c (older runs lack it: nan)."""
    steady = _levels(run, OURS)[c].get("ttfa_steady") or {}
    return steady.get("p95", math.nan) * 1000


def _steady_cliff(run: dict, c: int) -> float:
    ours = _levels(run, OURS)
    return _steady_p95(run, c) / (ours[1]["ttfa"]["p95"] * 1000) if 1 in ours else math.nan


def _audio_rate(run: dict, c: int) -> float:
    return _levels(run, OURS)[c]["audio_seconds_per_second"]


def _vs_floor(run: dict, c: int) -> float:
    floor = _levels(run, FLOOR)[c]["audio_seconds_per_second"]
    return _audio_rate(run, c) / floor if floor else float("nan")


def _cliff(run: dict, c: int) -> float:
    ours = _levels(run, OURS)
    return ours[c]["ttfa"]["p95"] / ours[1]["ttfa"]["p95"] if 1 in ours else float("nan")


METRICS: dict[str, tuple[Metric, str]] = {
    "TTFA p50 ms": (_ttfa("p50"), "{:.0f}"),
    "TTFA p95 ms": (_ttfa("p95"), "{:.0f}"),
    "audio s/s": (_audio_rate, "{:.1f}"),
    "vs floor": (_vs_floor, "{:.2f}x"),
    "p95 / c=1 p95": (_cliff, "{:.1f}x"),
    "steady p95 ms": (_steady_p95, "{:.0f}"),
    "steady p95 / c=1 p95": (_steady_cliff, "{:.1f}x"),
}


def medians(runs: list[dict], c: int) -> dict[str, tuple[float, float, float]]:
    """metric -> (median, min, max) over the runs at concurrency c."""
    out = {}
    for name, (metric, _) in METRICS.items():
        values = [v for v in (metric(run, c) for run in runs) if not math.isnan(v)]
        nan = math.nan
        out[name] = (statistics.median(values), min(values), max(values)) if values else (nan,) * 3
    return out


def _fmt(fmt: str, value: float) -> str:
    return "-" if math.isnan(value) else fmt.format(value)


def table(runs: dict[str, list[dict]]) -> str:
    levels = sorted({c for rs in runs.values() for r in rs for c in _levels(r, OURS)})
    rows = tables.header(["variant", "rounds", "c", *METRICS], "lrr" + "r" * len(METRICS))
    for label, rs in runs.items():
        for c in levels:
            cells = []
            for name, (med, low, high) in medians(rs, c).items():
                fmt = METRICS[name][1]
                span = f" ({_fmt(fmt, low)}-{_fmt(fmt, high)})" if len(rs) > 1 else ""
                cells.append(_fmt(fmt, med) + ("" if math.isnan(med) else span))
            rows.append(tables.row([label, len(rs), c, *cells]))
    loads = [
        f"{label}: {min(r['machine']['loadavg_at_start'][0] for r in rs):.1f}-"
        f"{max(r['machine']['loadavg_at_start'][0] for r in rs):.1f}"
        for label, rs in runs.items()
    ]
    rows.append("")
    rows.append("load average (1 min) at the start of each run: " + "; ".join(loads))
    return "\n".join(rows) + "\n"


def plot(runs: dict[str, list[dict]], out: Path, title: str) -> None:
    levels = sorted({c for rs in runs.values() for r in rs for c in _levels(r, OURS)})
    fig, ax = plots.figure(height=3.8)
    for label, rs in runs.items():
        p50 = [medians(rs, c)["TTFA p50 ms"][0] for c in levels]
        p95 = [medians(rs, c)["TTFA p95 ms"][0] for c in levels]
        steady = [medians(rs, c)["steady p95 ms"][0] for c in levels]
        (line,) = ax.plot(levels, p50, "o-", label=f"{label} p50")
        ax.plot(levels, p95, "s--", color=line.get_color(), label=f"{label} p95")
        if not all(math.isnan(v) for v in steady):
            ax.plot(levels, steady, "^:", color=line.get_color(), label=f"{label} steady p95")
    ax.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="TTFA (ms)", title=title)
    ax.set_yticks([t for t in (50, 100, 200, 500, 1000, 2000) if t <= 1.5 * ax.get_ylim()[1]])
    plots.finish(ax, levels, plain_y=True)
    plots.save(fig, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omni_bench.speech_compare", description=__doc__)
    p.add_argument("--run", action="append", required=True, help="LABEL=path/to/speech.json")
    p.add_argument("--plot", type=Path, help="write the TTFA plot (PNG) here")
    p.add_argument("--title", default="Time to first audio, median of rounds", help="plot title")
    args = p.parse_args(argv)
    try:
        runs = load_runs(args.run)
        print(table(runs), end="")
        if args.plot:
            plot(runs, args.plot, args.title)
    except (OSError, ValueError, KeyError) as err:
        print(f"speech_compare: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
