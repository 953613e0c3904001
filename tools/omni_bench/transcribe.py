"""omni-bench transcribe: the served ASR model against faster-whisper in this process.

    python -m omni_bench.transcribe [--short 12] [--heldout 15] [--long-seconds 300]
        [--levels 1,4,8] [--beam 5]

Audio is made here: the embedded voice reading the dataset's sentences and held-out sentences
(short clips of 3-10 s), the held-out clips with white noise at `--snr` dB, espeak-ng (a second,
harder voice) reading the held-out texts, and a long file of the dataset's sentences joined by
0.5-2 s pauses. The peers run in this process with the same model files and 2 CPU threads:
faster-whisper's plain `transcribe` (sequential 30 s windows with seeks) at the server's beam
(`--beam`, its own defaults otherwise: the temperature fallback ladder; the floor a served
request is held to) and greedy, its `BatchedInferencePipeline` (its own Silero VAD, batch 8) on
the long file, and the stage's recognizer without the server. The server
(`omni-server --repo REPO`, started here unless `--url` names one) gets:

  - every short clip at each concurrency level: throughput (audio seconds per wall second),
    mean real-time factor (latency / audio length), WER;
  - the held-out, noisy and espeak clips at c=1: WER served vs in-process;
  - the long file, whole (c=1) and streamed (time to the first `transcript.text.delta`).

Interleaved: each served run comes right after its in-process peers on the same audio (the
server idles meanwhile, and peers and server never run at once on the 2 cores), and the
verdicts hold each served run to the floor measured just before it, so both saw the machine's
load of the moment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from omni_bench import asr_audio, proc_cpu
from omni_bench.harness import tables
from omni_bench.harness.server import OmniServer
from omni_bench.harness.timing import closed_loop, percentile
from omni_bench.wer import word_error_rate
from omni_server.audio import whisper

MODEL = "whisper-1"
RATE = asr_audio.RATE


@dataclass
class Corpus:
    """Clips with their texts. The uploads (16-bit WAV) are what the server is sent; `clips`
    become those uploads decoded, so the in-process peers hear exactly what a served request
    carries: the quantization alone moves a word now and then (tiny.en heard "hung new" as
    "unused")."""

    name: str
    clips: list[np.ndarray]
    texts: list[str]
    uploads: list[bytes] = field(init=False)

    def __post_init__(self) -> None:
        self.uploads = [asr_audio.to_wav(clip) for clip in self.clips]
        self.clips = [asr_audio.decode_file(upload) for upload in self.uploads]

    @property
    def seconds(self) -> float:
        return sum(c.size for c in self.clips) / RATE


@dataclass
class Run:
    """One way of transcribing one corpus."""

    who: str
    corpus: str
    concurrency: int
    audio_s: float
    wall_s: float
    latencies: list[float] = field(default_factory=list)
    rtfs: list[float] = field(default_factory=list)
    wer: float | None = None
    first_text_s: float | None = None
    cpu_s: float | None = None  # CPU seconds spent (this process, or the server's process tree)
    # the machine's 1-minute load average as the run started (a shared machine's neighbours)
    load: float = field(default_factory=lambda: os.getloadavg()[0])

    @property
    def throughput(self) -> float:
        return self.audio_s / self.wall_s

    @property
    def audio_per_cpu(self) -> float | None:
        """Audio seconds per CPU second: the work a way of transcribing costs, which a busy
        machine disturbs much less than wall time."""
        return self.audio_s / self.cpu_s if self.cpu_s else None


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _tree_cpu(pid: int | None) -> float | None:
    if pid is None:
        return None
    return sum(proc_cpu.snapshot(pid).processes.values())


def make_corpora(args: argparse.Namespace) -> tuple[list[Corpus], Corpus]:
    """The short corpora (the dataset's sentences first; then held-out sentences, clean, with
    noise and by espeak-ng) and the long file."""
    voice = asr_audio.VoiceSynth()

    texts = [t for t in asr_audio.sentences(60, max_words=28) if len(t.split()) >= 8]
    short_texts = texts[: args.short]
    short = Corpus("voice", [voice.say(t) for t in short_texts], short_texts)
    held_texts = asr_audio.sentences(args.heldout, source=asr_audio.HELD_OUT)
    held = Corpus("voice held-out", [voice.say(t) for t in held_texts], held_texts)
    noisy = [asr_audio.add_noise(c, args.snr, seed=i) for i, c in enumerate(held.clips)]
    corpora = [short, held, Corpus(f"held-out {args.snr:g} dB SNR", noisy, held_texts)]
    if not args.no_espeak:
        try:
            espeak = asr_audio.EspeakSynth()
            clips = [espeak.say(t) for t in held_texts]
            corpora.append(Corpus("espeak-ng held-out", clips, held_texts))
        except RuntimeError as err:
            print(f"espeak-ng left out: {err}", file=sys.stderr)
    # the long file: the dataset's sentences, spoken once each, then again, until long enough
    long_clips: list[np.ndarray] = []
    long_texts: list[str] = []
    every = asr_audio.sentences(100, max_words=60)
    said = {t: c for t, c in zip(short_texts, short.clips, strict=True)}
    while sum(c.size for c in long_clips) / RATE < args.long_seconds * 0.8:
        text = every[len(long_texts) % len(every)]
        if text not in said:
            said[text] = voice.say(text)
        long_clips.append(said[text])
        long_texts.append(text)
    joined = asr_audio.join_with_pauses(long_clips, long_texts, pause_s=(0.5, 2.0), seed=1)
    long = Corpus("voice long file", [joined.samples], [joined.text])
    return corpora, long


# ---- in-process peers ---------------------------------------------------------------------


def inprocess(who: str, corpus: Corpus, transcribe: Callable[[np.ndarray], str]) -> Run:
    """`transcribe` over the corpus in this process, one clip after another, each timed."""
    hyps, latencies = [], []
    cpu = _own_cpu()
    start = time.perf_counter()
    for clip in corpus.clips:
        t = time.perf_counter()
        hyps.append(transcribe(clip))
        latencies.append(time.perf_counter() - t)
    wall = time.perf_counter() - start
    return _run(who, corpus, 1, wall, latencies, hyps, _own_cpu() - cpu)


def sequential_name(beam: int) -> str:
    return f"faster-whisper sequential (beam {beam})"


def inprocess_sequential(model: Any, corpus: Corpus, beam: int = 1) -> Run:
    """faster-whisper's plain transcribe, one clip after another: greedy at beam 1, else its
    own defaults (this beam, the temperature fallback ladder)."""
    fallback = {} if beam > 1 else {"temperature": 0.0}

    def transcribe(clip: np.ndarray) -> str:
        segments, _ = model.transcribe(
            clip, language="en", beam_size=beam, vad_filter=False, **fallback
        )
        return " ".join(s.text.strip() for s in segments)

    return inprocess(sequential_name(beam), corpus, transcribe)


def inprocess_batched(model: Any, corpus: Corpus, batch_size: int = 8) -> Run:
    """faster-whisper's BatchedInferencePipeline (its own Silero VAD), one clip after another."""
    from faster_whisper import BatchedInferencePipeline

    pipeline = BatchedInferencePipeline(model)

    def transcribe(clip: np.ndarray) -> str:
        segments, _ = pipeline.transcribe(
            clip, language="en", beam_size=1, temperature=0.0, batch_size=batch_size
        )
        return " ".join(s.text.strip() for s in segments)

    return inprocess(f"faster-whisper batched ({batch_size})", corpus, transcribe)


def inprocess_stage_code(recognizer: whisper.Recognizer, corpus: Corpus) -> Run:
    """The served stages' recognizer (segmenter + batched windows), without the server."""
    who = f"stage code in-process (batch {recognizer.batch_size}, beam {recognizer.beam_size})"
    return inprocess(who, corpus, lambda clip: recognizer.transcribe(clip, RATE))


def _run(
    who: str,
    corpus: Corpus,
    c: int,
    wall: float,
    latencies: list[float],
    hyps: Sequence[str],
    cpu_s: float,
) -> Run:
    rtfs = [lat / (clip.size / RATE) for lat, clip in zip(latencies, corpus.clips, strict=True)]
    return Run(
        who,
        corpus.name,
        c,
        corpus.seconds,
        wall,
        latencies,
        rtfs,
        word_error_rate(corpus.texts, hyps),
        cpu_s=cpu_s,
    )


# ---- the server ---------------------------------------------------------------------------


async def _transcribe(session: aiohttp.ClientSession, url: str, wav: bytes) -> str:
    form = aiohttp.FormData()
    form.add_field("model", MODEL)
    form.add_field("response_format", "text")
    form.add_field("file", wav, filename="clip.wav", content_type="audio/wav")
    async with session.post(url + "/v1/audio/transcriptions", data=form) as response:
        body = await response.text()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {body[:300]}")
        return body.strip()


async def _first_text(
    session: aiohttp.ClientSession, url: str, wav: bytes
) -> tuple[float, float, str]:
    """(seconds to the first delta, to the done event, the done text) of a streamed request."""
    form = aiohttp.FormData()
    form.add_field("model", MODEL)
    form.add_field("stream", "true")
    form.add_field("file", wav, filename="clip.wav", content_type="audio/wav")
    start = time.perf_counter()
    first = None
    async with session.post(url + "/v1/audio/transcriptions", data=form) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "transcript.text.delta" and first is None:
                first = time.perf_counter() - start
            if event["type"] == "transcript.text.done":
                done = time.perf_counter() - start
                return (first if first is not None else done), done, event["text"]
    raise RuntimeError("the stream ended without transcript.text.done")


async def served(
    session: aiohttp.ClientSession,
    url: str,
    corpus: Corpus,
    c: int,
    rounds: int,
    pid: int | None = None,
    who: str = "served",
) -> Run:
    """Every clip `rounds` times, `c` requests in flight at once."""
    load = os.getloadavg()[0]
    wavs = corpus.uploads
    hyps: dict[int, str] = {}
    latencies: list[float] = []
    rtfs: list[float] = []

    async def one(i: int) -> None:
        t = time.perf_counter()
        hyps[i] = await _transcribe(session, url, wavs[i])
        lat = time.perf_counter() - t
        latencies.append(lat)
        rtfs.append(lat / (corpus.clips[i].size / RATE))

    cpu = _tree_cpu(pid)
    wall = await closed_loop((i for _ in range(rounds) for i in range(len(wavs))), c, one)
    after = _tree_cpu(pid)
    cpu_s = after - cpu if after is not None and cpu is not None else None
    wer = word_error_rate(corpus.texts, [hyps[i] for i in range(len(wavs))])
    audio = corpus.seconds * rounds
    return Run(who, corpus.name, c, audio, wall, latencies, rtfs, wer, cpu_s=cpu_s, load=load)


async def interleaved(
    args: argparse.Namespace, model: Any, corpora: list[Corpus], long: Corpus
) -> list[Run]:
    """Every served run right after its in-process peers on the same audio (the server idles
    while they run, the peers while it serves), so both see the machine's load of the moment."""
    server = None
    url = args.url
    if url is None:
        server = OmniServer(args.repo)
        await server.start()
        url = server.url
    pid = server.pid if server is not None else args.server_pid
    before = None
    before_who = f"served ({args.compare_label})"
    runs: list[Run] = []

    def note(run: Run) -> Run:
        runs.append(run)
        print(_line(run), file=sys.stderr)
        return run

    try:
        if args.compare_repo is not None:  # a second server, measured right after the first
            before = OmniServer(args.compare_repo)
            await before.start()
        timeout = aiohttp.ClientTimeout(total=900)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            voice = corpora[0]
            await _transcribe(session, url, voice.uploads[0])  # warm-up
            inprocess_sequential(model, Corpus("warm-up", voice.clips[:1], voice.texts[:1]))
            for c in args.levels:
                rounds = max(1, -(-2 * c // len(voice.clips)))
                note(inprocess_sequential(model, voice, args.beam))
                note(await served(session, url, voice, c, rounds, pid))
                if before is not None:
                    await _transcribe(session, before.url, voice.uploads[0])  # warm-up
                    note(
                        await served(session, before.url, voice, c, rounds, before.pid, before_who)
                    )
            for corpus in corpora[1:] if not args.no_conditions else []:
                if args.beam != 1:
                    note(inprocess_sequential(model, corpus, 1))
                note(inprocess_sequential(model, corpus, args.beam))
                note(await served(session, url, corpus, 1, 1, pid))
            if args.beam != 1:
                note(inprocess_sequential(model, long, 1))
            note(inprocess_sequential(model, long, args.beam))
            note(inprocess_batched(model, long))
            stage = whisper.Recognizer(model, batch_size=4, beam_size=args.beam)
            note(inprocess_stage_code(stage, long))
            note(await served(session, url, long, 1, 1, pid))
            if before is not None:
                note(await served(session, before.url, long, 1, 1, before.pid, before_who))
            first, done, text = await _first_text(session, url, long.uploads[0])
            run = Run(
                "served, stream=true",
                long.name,
                1,
                long.seconds,
                done,
                [done],
                [done / long.seconds],
            )
            run.first_text_s, run.wer = first, word_error_rate(long.texts, [text])
            note(run)
            first, done, text = await _first_text(session, url, voice.uploads[0])
            run = Run(
                "served, stream=true", "voice (first clip)", 1, voice.clips[0].size / RATE, done
            )
            run.first_text_s, run.wer = first, word_error_rate(voice.texts[:1], [text])
            note(run)
    finally:
        if server is not None:
            await server.stop(check=True)
        if before is not None:
            await before.stop(check=True)
    return runs


# ---- report -------------------------------------------------------------------------------


def _line(r: Run) -> str:
    return f"{r.who:38} {r.corpus:20} c={r.concurrency} {r.throughput:6.1f} audio s/s wer={r.wer}"


def table(runs: list[Run]) -> str:
    lines = tables.header(TABLE_COLUMNS, "ll" + "r" * 10)
    for r in runs:
        rtf = statistics.fmean(r.rtfs) if r.rtfs else float("nan")
        first = f"{r.first_text_s:.2f}" if r.first_text_s is not None else ""
        wer = f"{100 * r.wer:.1f}" if r.wer is not None else ""
        per_cpu = f"{r.audio_per_cpu:.1f}" if r.audio_per_cpu is not None else ""
        measured = [f"{r.audio_s:.0f}", f"{r.wall_s:.2f}", f"{r.throughput:.1f}", per_cpu]
        latency = [f"{rtf:.3f}", f"{percentile(r.latencies, 90):.2f}", first, wer]
        row = [r.who, r.corpus, r.concurrency, *measured, *latency, f"{r.load:.1f}"]
        lines.append(tables.row(row))
    return "\n".join(lines)


TABLE_COLUMNS = [
    "who", "audio", "c", "audio s", "wall s", "throughput (audio s/s)", "audio s per CPU s",
    "mean RTF", "p90 latency s", "first text s", "WER %", "load",
]  # fmt: skip


def verdicts(runs: list[Run], beam: int) -> list[str]:
    """The issue's targets: short clips at >= 0.95x the in-process floor measured just before
    them (the same beam), the long file >= 1.5x sequential faster-whisper, served WER not worse
    than faster-whisper's own transcribe on the same audio."""

    def before(i: int, who: str) -> Run | None:
        """The last run of `who` on the same audio before runs[i]."""
        return next(
            (r for r in reversed(runs[:i]) if r.who == who and r.corpus == runs[i].corpus), None
        )

    out = []
    floor_name = sequential_name(beam)
    for i, r in enumerate(runs):
        if r.who != "served":
            continue
        floor = before(i, floor_name)
        if floor is None:
            continue
        if r.corpus == "voice long file":
            out.append(
                f"long file: served {r.wall_s:.1f} s vs {floor_name} {floor.wall_s:.1f} s = "
                f"{floor.wall_s / r.wall_s:.2f}x faster (target >= 1.5x)"
            )
            greedy = before(i, sequential_name(1))
            if greedy is not None and beam != 1:
                out.append(
                    f"  vs greedy sequential {greedy.wall_s:.1f} s = "
                    f"{greedy.wall_s / r.wall_s:.2f}x"
                )
            if r.cpu_s and floor.cpu_s:
                out.append(
                    f"  CPU seconds: served {r.cpu_s:.1f} vs sequential {floor.cpu_s:.1f} "
                    f"= {floor.cpu_s / r.cpu_s:.2f}x less work"
                )
        elif r.corpus == "voice":
            out.append(
                f"short clips c={r.concurrency}: served {r.throughput:.1f} audio s/s = "
                f"{r.throughput / floor.throughput:.2f}x the in-process floor just before "
                f"({floor.throughput:.1f}; target >= 0.95x)"
            )
            if r.audio_per_cpu and floor.audio_per_cpu:
                out.append(
                    f"  per CPU second: served {r.audio_per_cpu:.1f} vs in-process "
                    f"{floor.audio_per_cpu:.1f} audio s = "
                    f"{r.audio_per_cpu / floor.audio_per_cpu:.2f}x"
                )
        if r.concurrency == 1 and floor.wer is not None and r.wer is not None:
            out.append(
                f"WER {r.corpus}: served {100 * r.wer:.1f}% vs faster-whisper's own "
                f"(beam {beam}) {100 * floor.wer:.1f}% "
                f"({100 * (r.wer - floor.wer):+.1f} points; target not worse)"
            )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", type=int, default=12, help="short clips of dataset texts")
    parser.add_argument("--heldout", type=int, default=15, help="short clips of held-out texts")
    parser.add_argument("--long-seconds", type=float, default=300.0)
    parser.add_argument("--levels", default="1,4,8", help="concurrency levels")
    parser.add_argument(
        "--no-conditions", action="store_true",
        help="leave out the held-out, noisy and espeak conditions (speed runs)",
    )  # fmt: skip
    parser.add_argument("--snr", type=float, default=10.0, help="SNR (dB) of the noisy condition")
    parser.add_argument(
        "--beam", type=int, default=whisper.SERVED_BEAM_SIZE,
        help="the beam the server decodes with (its asr_whisper beam_size): the peers' too",
    )  # fmt: skip
    parser.add_argument("--no-espeak", action="store_true")
    parser.add_argument("--repo", type=Path, default=asr_audio.REPOSITORY)
    parser.add_argument("--url", help="a running server instead of starting one")
    parser.add_argument("--server-pid", type=int, help="with --url: its pid, for CPU seconds")
    parser.add_argument("--json", type=Path, help="write the runs here")
    parser.add_argument(
        "--compare-repo", type=Path,
        help="a second repository served beside --repo, each served run repeated on it",
    )  # fmt: skip
    parser.add_argument("--compare-label", default="before", help="its rows' name")
    args = parser.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",")]

    corpora, long = make_corpora(args)
    print(
        f"audio: {len(corpora[0].clips)} dataset and {len(corpora[1].clips)} held-out short "
        f"clips ({corpora[0].seconds + corpora[1].seconds:.0f} s), long file {long.seconds:.0f} s",
        file=sys.stderr,
    )
    model = whisper.load_whisper(cpu_threads=2)
    runs = asyncio.run(interleaved(args, model, corpora, long))
    print(table(runs))
    print()
    for line in verdicts(runs, args.beam):
        print("- " + line)
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in runs], indent=1))


if __name__ == "__main__":
    main()
