"""Speech-serving metrics computed from the timings of individual requests.

All times are seconds on one monotonic clock (`time.perf_counter`). A request's timing is its
send time, the arrival time and size of every body chunk, and its end time; its audio duration
comes from the decoded clip. Everything else (TTFA, gaps, underrun, throughput) derives from
those few numbers, so the same functions judge our server, Piper's HTTP server and the voice run
in-process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from omni_bench.harness.timing import percentiles

__all__ = [
    "UNDERRUN_TOLERANCE_S",
    "Chunk",
    "LevelSummary",
    "RequestTiming",
    "inter_chunk_gaps",
    "latency",
    "percentiles",
    "playback_underrun",
    "rtf",
    "summarize",
    "ttfa",
]


@dataclass
class Chunk:
    """One piece of the response body as the client saw it arrive."""

    at: float  # arrival time
    nbytes: int


@dataclass
class RequestTiming:
    """What one request did, as seen by the client."""

    text: str
    start: float
    end: float = math.nan
    chunks: list[Chunk] = field(default_factory=list)
    audio_seconds: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


def ttfa(t: RequestTiming) -> float:
    """Time to first audio: send to the first body byte."""
    if not t.chunks:
        raise ValueError(f"request for {t.text[:40]!r} returned no body")
    return t.chunks[0].at - t.start


def latency(t: RequestTiming) -> float:
    """End-to-end latency: send to the last body byte (the response end)."""
    return t.end - t.start


def rtf(t: RequestTiming) -> float:
    """Real-time factor: latency / audio seconds (below 1 is faster than real time)."""
    if t.audio_seconds <= 0:
        raise ValueError(f"request for {t.text[:40]!r} returned no audio")
    return latency(t) / t.audio_seconds


def inter_chunk_gaps(t: RequestTiming) -> list[float]:
    """Time between consecutive body chunks (empty for a one-chunk response)."""
    return [b.at - a.at for a, b in zip(t.chunks, t.chunks[1:], strict=False)]


# A stream counts as underrun when its listener would have waited longer than this for audio:
# below it the deficit is the clock's and the socket's jitter, not a stall anyone hears.
UNDERRUN_TOLERANCE_S = 0.005


def playback_underrun(t: RequestTiming) -> float:
    """The worst deficit of a listener who starts playing at the first byte.

    The listener plays continuously from the first chunk's arrival. Chunk i arrives at a_i; by
    then the listener needs `a_i - a_0` seconds of audio but has only the audio of chunks
    0..i-1. The underrun is the largest shortfall over all chunks (0 when the stream always
    kept ahead of playback); it equals the smallest start-up buffer that would have avoided
    every stall. Each chunk's audio is its share of the clip's bytes, which is exact for raw
    PCM and for the in-process voice, and a constant-bitrate estimate for compressed formats.
    """
    if not t.chunks:
        raise ValueError(f"request for {t.text[:40]!r} returned no body")
    total = t.nbytes
    if total == 0 or t.audio_seconds <= 0:
        return 0.0
    seconds_per_byte = t.audio_seconds / total
    first = t.chunks[0].at
    worst = 0.0
    buffered = 0  # bytes received before the chunk being looked at
    for chunk in t.chunks:
        worst = max(worst, (chunk.at - first) - buffered * seconds_per_byte)
        buffered += chunk.nbytes
    return worst


@dataclass
class LevelSummary:
    """Aggregates of one concurrency level of one target."""

    concurrency: int
    requests: int
    failed: int
    wall_seconds: float
    requests_per_second: float
    audio_seconds_per_second: float
    ttfa: dict[str, float]
    latency: dict[str, float]
    rtf: dict[str, float]
    max_gap: dict[str, float]  # per request: its longest inter-chunk gap
    underrun: dict[str, float]
    errors: list[str] = field(default_factory=list)
    # the share of streams whose listener ran dry (underrun above UNDERRUN_TOLERANCE_S), and
    # the worst deficit of any of them (seconds)
    underrun_share: float = math.nan
    worst_deficit: float = math.nan
    # open loop: the request rate the level was sent at (requests/s; None: closed loop)
    rate: float | None = None
    # TTFA of the requests sent after the level's first `concurrency` ones: those all start at
    # the same instant, a burst that a closed loop in its steady state does not have.
    ttfa_steady: dict[str, float] = field(default_factory=dict)
    # The server's own view of the level (server_stats.breakdown), when it exposes /metrics.
    server: dict[str, dict[str, float]] = field(default_factory=dict)
    # Cores kept busy during the level (proc_cpu.cores): "bench" (this process and its
    # children, e.g. Piper's server) and, with --server-pid, "server".
    cpu: dict[str, dict] = field(default_factory=dict)


def summarize(
    concurrency: int, timings: Sequence[RequestTiming], wall: float, rate: float | None = None
) -> LevelSummary:
    """Summarize one level; throughput counts successful requests over the level's wall time."""
    ok = [t for t in timings if t.ok]
    failed = [t for t in timings if not t.ok]
    underruns = [playback_underrun(t) for t in ok]
    return LevelSummary(
        rate=rate,
        underrun_share=(
            sum(u > UNDERRUN_TOLERANCE_S for u in underruns) / len(underruns)
            if underruns
            else math.nan
        ),
        worst_deficit=max(underruns, default=math.nan),
        concurrency=concurrency,
        requests=len(timings),
        failed=len(failed),
        wall_seconds=wall,
        requests_per_second=len(ok) / wall if wall > 0 else math.nan,
        audio_seconds_per_second=sum(t.audio_seconds for t in ok) / wall if wall > 0 else math.nan,
        ttfa=percentiles([ttfa(t) for t in ok]),
        latency=percentiles([latency(t) for t in ok]),
        rtf=percentiles([rtf(t) for t in ok]),
        max_gap=percentiles([max(inter_chunk_gaps(t), default=0.0) for t in ok]),
        underrun=percentiles(underruns),
        errors=sorted({t.error for t in failed if t.error})[:5],
        ttfa_steady=percentiles(
            [ttfa(t) for t in sorted(timings, key=lambda t: t.start)[concurrency:] if t.ok]
        ),
    )
