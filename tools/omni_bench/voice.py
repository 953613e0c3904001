"""Measure the embedded voice in-process (a benchmark script, not a test): prints tables.

    python tests/voice/measure_voice.py [--rounds N]

1. per-stage cost of one request (text_frontend, acoustic per sentence, audio_encoder per format);
2. onnxruntime intra-op threads 1 vs 2: per-sentence latency alone, and throughput with 1 or 2
   workers (each worker stands for one acoustic replica: its own session, its own thread; ORT
   releases the GIL while it runs, as two processes would run it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from omni_bench.inprocess import InProcessVoice
from omni_server.audio.encode import FORMATS, AudioEncoder, default_sample_rate
from omni_server.audio.resample import StreamResampler

# the embedded repository, from the working directory (a source checkout) unless the
# environment names another: an installed omni_bench has no repository beside it
REPOSITORY = Path(os.environ.get("OMNI_REPOSITORY", "repository"))
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "It was a bright cold day in April, and the clocks were striking thirteen.",
    "We will meet at the station just after noon.",
    "Six spoons of fresh snow peas, five thick slabs of blue cheese, "
    "and maybe a snack for her brother Bob.",
    "How are you today?",
]


def per_stage(voice: InProcessVoice) -> None:
    acoustic = voice.acoustic.voices["joe"]
    rate = acoustic.sample_rate
    print("\n## Per sentence, one request at a time (intra_op_threads = 1)\n")
    print("| sentence chars | phoneme ids | frontend ms | synthesis ms | audio s | RTF |")
    print("|---:|---:|---:|---:|---:|---:|")
    rtfs, audios = [], []
    for text in SENTENCES:
        t0 = time.perf_counter()
        first = next(voice.frontend_chunks(voice.request(text)))
        t1 = time.perf_counter()
        ids = first["phoneme_ids"]
        times = []
        for seed in range(5):
            s = time.perf_counter()
            audio = acoustic.synthesize(ids, speed=1.0, rng=np.random.default_rng(seed))
            times.append(time.perf_counter() - s)
        synth = statistics.median(times)
        seconds = len(audio) / rate
        rtfs.append(synth / seconds)
        audios.append(audio)
        print(
            f"| {len(text)} | {len(ids)} | {(t1 - t0) * 1e3:.1f} | {synth * 1e3:.0f} "
            f"| {seconds:.2f} | {synth / seconds:.3f} |"
        )
    print(f"\nmedian RTF {statistics.median(rtfs):.3f} (synthesis seconds per audio second)")
    print("\n## audio_encoder: ms per second of audio (resample + encode, streamed)\n")
    print("| format | output Hz | ms per audio s |")
    print("|---|---:|---:|")
    total = sum(len(a) for a in audios) / rate
    for fmt in FORMATS:
        out_rate = default_sample_rate(fmt, rate)
        s = time.perf_counter()
        for _ in range(3):
            resampler, encoder = (
                StreamResampler(rate, out_rate),
                AudioEncoder(fmt, out_rate, streaming=True),
            )
            for a in audios:
                encoder.encode(resampler.push(a))
            encoder.encode(resampler.flush())
            encoder.finish()
        ms = (time.perf_counter() - s) / 3 * 1e3 / total
        print(f"| {fmt} | {out_rate} | {ms:.2f} |")


def throughput(voices: list[InProcessVoice], jobs: int = 24) -> tuple[float, float, float, float]:
    """Run `jobs` sentences on the voices' acoustic models, one worker thread each.

    Returns (audio seconds per second, median and p90 sentence latency s, CPU seconds per
    audio second): CPU time is the measure other work on a shared machine disturbs least.
    """
    ids = [next(voices[0].frontend_chunks(voices[0].request(t)))["phoneme_ids"] for t in SENTENCES]
    latencies: list[float] = []
    produced = [0]
    lock = threading.Lock()
    counter = iter(range(jobs))

    def work(voice: InProcessVoice) -> None:
        acoustic = voice.acoustic.voices["joe"]
        while True:
            with lock:
                job = next(counter, None)
            if job is None:
                return
            s = time.perf_counter()
            audio = acoustic.synthesize(
                ids[job % len(ids)], speed=1.0, rng=np.random.default_rng(job)
            )
            with lock:
                latencies.append(time.perf_counter() - s)
                produced[0] += len(audio)

    start, cpu = time.perf_counter(), time.process_time()
    pool = [threading.Thread(target=work, args=(v,)) for v in voices]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    audio_s = produced[0] / 22050
    latencies.sort()
    return (
        audio_s / wall,
        statistics.median(latencies),
        latencies[int(0.9 * len(latencies))],
        cpu / audio_s,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    voice = InProcessVoice(REPOSITORY)
    per_stage(voice)
    configs = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (intra-op threads, workers)
    voices = {
        c: [InProcessVoice(REPOSITORY, acoustic={"intra_op_threads": c[0]}) for _ in range(c[1])]
        for c in configs
    }
    best: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.rounds):  # interleaved; each metric keeps its least disturbed round
        for c in configs:
            row = list(throughput(voices[c]))
            old = best.setdefault(c, row)
            best[c] = [
                max(old[0], row[0]),
                *(min(a, b) for a, b in zip(old[1:], row[1:], strict=True)),
            ]
    print(f"\n## intra_op_threads x acoustic workers (24 sentences, best of {args.rounds})\n")
    print(
        "| intra-op threads | workers (concurrent sentences) | audio s / s "
        "| median latency ms | p90 latency ms | CPU s per audio s |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for (threads, workers), (rate, p50, p90, cpu) in best.items():
        print(
            f"| {threads} | {workers} | {rate:.1f} | {p50 * 1e3:.0f} | {p90 * 1e3:.0f} "
            f"| {cpu:.3f} |"
        )


if __name__ == "__main__":
    main()
