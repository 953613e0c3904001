"""Turning a speech run's result dict into a markdown report, ratio tables, verdicts and plots."""

from __future__ import annotations

import math
from pathlib import Path

from omni_bench.harness import plots, tables
from omni_bench.metrics import LevelSummary

OURS = "omni-server"
FLOOR = "in-process"

# The targets our server is held to on this machine (docs/benchmarks.md, "Targets").
THROUGHPUT_VS_FLOOR = 0.95  # at concurrency >= 4, vs the in-process floor at the same level
TTFA_VS_FIRST_SENTENCE = 1.2  # TTFA p50 at c=1 vs the in-process first-sentence time p50
TTFA_CLIFF = 2.0  # TTFA p95 at c=16 vs TTFA p95 at c=1
UNDERRUN_LEVELS = 16  # no stream may underrun at concurrency up to this
WER_TOLERANCE = 0.01  # absolute: both sides sample VITS noise, so equal voices differ by chance


def ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:.0f}"


def level_line(name: str, level: LevelSummary, load: float) -> str:
    where = f"c={level.concurrency:<3}" if level.rate is None else f"{level.rate:g} req/s"
    return (
        f"{name:>12} {where} {level.requests_per_second:6.2f} req/s "
        f"{level.audio_seconds_per_second:6.1f} audio s/s  TTFA p50 {ms(level.ttfa['p50'])} ms "
        f"p95 {ms(level.ttfa['p95'])} ms  failed {level.failed}  (load avg before {load:.2f})"
    )


def _by_level(result: dict) -> dict[str, dict[int, dict]]:
    """Closed-loop levels by concurrency (open-loop levels have none, and no targets)."""
    return {
        t["name"]: {x["concurrency"]: x for x in t["levels"] if x.get("rate") is None}
        for t in result["targets"]
    }


def load_cell(x: dict) -> str:
    """A level's load as a table cell: its concurrency, or its open-loop request rate."""
    rate = x.get("rate")
    return str(x["concurrency"]) if rate is None else f"{rate:g}/s"


def _ratio(a: float, b: float) -> str:
    return "-" if not b or math.isnan(a) or math.isnan(b) else f"{a / b:.2f}x"


def verdicts(result: dict) -> list[dict]:
    """The targets (throughput, first-audio time, its cliff, underruns, WER), each with its
    measured value, its bound and met / missed."""
    levels = _by_level(result)
    wers = {t["name"]: t["wer"] for t in result["targets"] if t["wer"]}
    ours, floor = levels.get(OURS), levels.get(FLOOR)
    out: list[dict] = []
    if ours and floor:
        for c in sorted(c for c in ours if c >= 4 and c in floor):
            got = ours[c]["audio_seconds_per_second"]
            bound = THROUGHPUT_VS_FLOOR * floor[c]["audio_seconds_per_second"]
            out.append(
                {
                    "target": f"throughput at c={c} >= {THROUGHPUT_VS_FLOOR}x in-process",
                    "value": f"{got:.1f} audio s/s ({_ratio(got, bound / THROUGHPUT_VS_FLOOR)})",
                    "bound": f">= {bound:.1f}",
                    "met": got >= bound,
                }
            )
        if 1 in ours and 1 in floor:
            got, first = ours[1]["ttfa"]["p50"], floor[1]["ttfa"]["p50"]
            out.append(
                {
                    "target": f"TTFA p50 at c=1 <= {TTFA_VS_FIRST_SENTENCE}x first sentence",
                    "value": f"{ms(got)} ms ({_ratio(got, first)} of {ms(first)} ms)",
                    "bound": f"<= {ms(TTFA_VS_FIRST_SENTENCE * first)} ms",
                    "met": got <= TTFA_VS_FIRST_SENTENCE * first,
                }
            )
    if ours and 1 in ours and 16 in ours:
        base, got = ours[1]["ttfa"]["p95"], ours[16]["ttfa"]["p95"]
        out.append(
            {
                "target": f"TTFA p95 at c=16 <= {TTFA_CLIFF}x its c=1 value",
                "value": f"{ms(got)} ms ({_ratio(got, base)} of {ms(base)} ms)",
                "bound": f"<= {ms(TTFA_CLIFF * base)} ms",
                "met": got <= TTFA_CLIFF * base,
            }
        )
    measured = [
        (c, x) for c, x in sorted((ours or {}).items())
        if c <= UNDERRUN_LEVELS and not math.isnan(x.get("underrun_share", math.nan))
    ]  # fmt: skip
    if measured:
        late = {c: x["underrun_share"] for c, x in measured if x["underrun_share"] > 0}
        worst = max(x["worst_deficit"] for _, x in measured)
        out.append(
            {
                "target": f"no stream underruns at c <= {UNDERRUN_LEVELS}",
                "value": ", ".join(f"c={c}: {_share(s)}" for c, s in late.items())
                or f"none (worst deficit {ms(worst)} ms)",
                "bound": "0 streams",
                "met": not late,
            }
        )
    if OURS in wers and FLOOR in wers:
        got, base = wers[OURS]["corpus_wer"], wers[FLOOR]["corpus_wer"]
        out.append(
            {
                "target": "corpus WER no worse than in-process",
                "value": f"{got:.2%} vs {base:.2%}",
                "bound": f"<= {base + WER_TOLERANCE:.2%} (in-process + {WER_TOLERANCE:.0%} noise)",
                "met": got <= base + WER_TOLERANCE,
            }
        )
    return out


def markdown(result: dict) -> str:
    m, s = result["machine"], result["settings"]
    lines = [
        "## Machine",
        "",
        f"{m['cpu']}, {m['cores']} cores, {m['platform']}, Python {m['python']}; "
        f"load average {m['loadavg_at_start'][0]:.2f} at start, "
        f"{m['loadavg_at_end'][0]:.2f} at end.",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Format {s['format']}, stream {s['stream']}, {s['requests_per_level']} requests per level "
        f"over {s['dataset_texts']} texts.",
        "",
        "## Latency and throughput (times in ms)",
        "",
        *tables.header(LATENCY_COLUMNS),
    ]
    for t in result["targets"]:
        for x in t["levels"]:
            lines.append(tables.row([t["name"], load_cell(x), *_latency_cells(x)]))
    lines += _vs_peers(result)
    lines += _server_breakdown(result)
    lines += _cpu_table(result)
    wers = [t for t in result["targets"] if t["wer"]]
    if wers:
        lines += ["", "## Round-trip WER (Whisper tiny.en, normalized)", ""]
        lines += tables.header(
            ["target", "clips", "corpus WER", "mean clip WER", "p95 clip WER", "clips > 50%"]
        )
        for t in wers:
            w = t["wer"]
            rates = (f"{w[k]:.2%}" for k in ("corpus_wer", "mean_clip_wer", "p95_clip_wer"))
            lines.append(tables.row([t["name"], w["clips"], *rates, w["clips_above_half"]]))
    checks = verdicts(result)
    if checks:
        lines += ["", "## Targets", "", *tables.header(["target", "measured", "bound", "verdict"])]
        for v in checks:
            verdict = "met" if v["met"] else "**missed**"
            lines.append(tables.row([v["target"], v["value"], v["bound"], verdict]))
    return "\n".join(lines) + "\n"


LATENCY_COLUMNS = [
    "target", "c (or rate)", "req/s", "audio s/s", "TTFA p50", "TTFA p95", "TTFA p99",
    "steady TTFA p95", "latency p50", "latency p95", "latency p99", "RTF p50", "RTF p95",
    "max gap p95", "underrun p95", "underrun p99", "streams underrun", "worst deficit", "failed",
]  # fmt: skip


def _latency_cells(x: dict) -> list[str]:
    """One level's cells after target and c, in LATENCY_COLUMNS' order."""
    return [
        f"{x['requests_per_second']:.2f}",
        f"{x['audio_seconds_per_second']:.1f}",
        *(ms(x["ttfa"][p]) for p in ("p50", "p95", "p99")),
        ms(x.get("ttfa_steady", {}).get("p95", math.nan)),
        *(ms(x["latency"][p]) for p in ("p50", "p95", "p99")),
        f"{x['rtf']['p50']:.3f}",
        f"{x['rtf']['p95']:.3f}",
        ms(x["max_gap"]["p95"]),
        *(ms(x["underrun"][p]) for p in ("p95", "p99")),
        _share(x.get("underrun_share", math.nan)),
        ms(x.get("worst_deficit", math.nan)),
        str(x["failed"]),
    ]


def _share(fraction: float) -> str:
    return "-" if math.isnan(fraction) else f"{fraction:.0%}"


def _vs_peers(result: dict) -> list[str]:
    """Ours / each peer at the same concurrency: throughput, TTFA p50, latency p50."""
    levels = _by_level(result)
    peers = [n for n in levels if n != OURS]
    if OURS not in levels or not peers:
        return []
    lines = ["", "## Ours vs peers (ratio = ours / peer, same concurrency)", ""]
    columns = ["c"]
    for p in peers:
        columns += [f"throughput vs {p}", f"TTFA p50 vs {p}", f"latency p50 vs {p}"]
    lines += tables.header(columns)
    throughput = "audio_seconds_per_second"
    for c, ours in sorted(levels[OURS].items()):
        cells: list[object] = [c]
        for p in peers:
            peer = levels[p].get(c)
            if peer is None:
                cells += ["-", "-", "-"]
                continue
            cells += [
                _ratio(ours[throughput], peer[throughput]),
                _ratio(ours["ttfa"]["p50"], peer["ttfa"]["p50"]),
                _ratio(ours["latency"]["p50"], peer["latency"]["p50"]),
            ]
        lines.append(tables.row(cells))
    return lines


def _server_breakdown(result: dict) -> list[str]:
    """Our server's stage queue and compute means per level, beside client and server TTFA."""
    levels = [x for t in result["targets"] if t["name"] == OURS for x in t["levels"]]
    if not any(x.get("server") for x in levels):
        return []
    series = sorted({k for x in levels for k in x["server"] if k != "server_ttfa"},
                    key=lambda k: (k.split(":")[1], k.startswith("compute")))  # fmt: skip
    lines = [
        "",
        "## Inside our server (means per request in ms, from its /metrics)",
        "",
        *tables.header(["c", "client TTFA", "server TTFA", *series]),
    ]
    for x in levels:
        server = x.get("server", {})
        cells = [f"{server[k]['mean_ms']:.1f}" if k in server else "-" for k in series]
        ttfa = f"{server['server_ttfa']['mean_ms']:.0f}" if "server_ttfa" in server else "-"
        lines.append(tables.row([load_cell(x), f"{x['ttfa']['mean'] * 1000:.0f}", ttfa, *cells]))
    return lines


def _cpu_table(result: dict) -> list[str]:
    """Cores each side kept busy per level, with the busiest threads (profiling at a glance)."""
    rows = []
    for t in result["targets"]:
        for x in t["levels"]:
            for side, cpu in x.get("cpu", {}).items():
                busiest = ", ".join(f"{name} {used:.2f}" for name, used in
                                    list(cpu["threads"].items())[:4])  # fmt: skip
                rows.append(
                    tables.row([t["name"], load_cell(x), side, f"{cpu['total']:.2f}", busiest])
                )
    if not rows:
        return []
    return [
        "",
        "## CPU (cores kept busy during each level; bench = the bench process and its children)",
        "",
        *tables.header(
            ["target", "c", "process tree", "cores", "busiest threads (process/thread cores)"]
        ),
        *rows,
    ]


def write_plots(result: dict, out: Path) -> list[Path]:
    """ttfa.png (p50 solid, p95 dashed) and throughput.png (audio s/s) against concurrency
    (or, for an open-loop run, the request rate)."""
    rates = result["settings"].get("rates") or []
    levels = rates or result["settings"]["concurrency"]
    x_key, x_label = ("rate", "requests / second") if rates else ("concurrency", "concurrency")
    fig, ax = plots.figure()
    for t in result["targets"]:
        cs = [x[x_key] for x in t["levels"]]
        p50 = [x["ttfa"]["p50"] * 1000 for x in t["levels"]]
        p95 = [x["ttfa"]["p95"] * 1000 for x in t["levels"]]
        (line,) = ax.plot(cs, p50, "o-", label=f"{t['name']} p50")
        ax.plot(cs, p95, "s--", color=line.get_color(), label=f"{t['name']} p95")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel=x_label,
        ylabel="TTFA (ms)",
        title="Time to first audio byte",
    )
    plots.finish(ax, levels)
    written = [plots.save(fig, out / "ttfa.png")]

    fig, ax = plots.figure()
    for t in result["targets"]:
        cs = [x[x_key] for x in t["levels"]]
        ax.plot(cs, [x["audio_seconds_per_second"] for x in t["levels"]], "o-", label=t["name"])
    ax.set(xscale="log", xlabel=x_label, ylabel="audio seconds / wall second", title="Throughput")
    ax.set_ylim(bottom=0)
    plots.finish(ax, levels)
    written.append(plots.save(fig, out / "throughput.png"))
    return written
