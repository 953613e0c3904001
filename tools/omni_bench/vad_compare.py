"""Silero VAD against webrtcvad on the same speech with pauses: boundary accuracy and speed.

    python -m omni_bench.vad_compare [--clips 12] [--snr 10]

Ground truth: each voice clip's first and last voiced 10 ms frame (40 dB below its peak), at the
place the clip was put in the file. A true utterance is found when one detected utterance
overlaps it; boundary errors are |detected - true| of the best-overlapping utterance.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from omni_bench import asr_audio
from omni_server.audio import vad


def _score(
    speech: asr_audio.Speech, truth: list[tuple[float, float]], found: list[vad.Utterance]
) -> dict:
    starts, ends, missed = [], [], 0
    for t0, t1 in truth:
        overlaps = [(min(t1, u.end) - max(t0, u.start), u) for u in found]
        best = max(overlaps, default=(0.0, None), key=lambda x: x[0])
        if best[1] is None or best[0] <= 0:
            missed += 1
            continue
        starts.append(abs(best[1].start - t0))
        ends.append(abs(best[1].end - t1))
    errors = np.array(starts + ends) * 1000
    return {
        "true": len(truth),
        "found": len(found),
        "missed": missed,
        "median_ms": float(np.median(errors)) if errors.size else float("nan"),
        "p90_ms": float(np.percentile(errors, 90)) if errors.size else float("nan"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=12)
    parser.add_argument("--snr", type=float, default=10.0, help="SNR (dB) of the noisy condition")
    args = parser.parse_args(argv)
    voice = asr_audio.VoiceSynth()
    texts = asr_audio.sentences(args.clips)
    clips = [voice.say(t) for t in texts]
    speech = asr_audio.join_with_pauses(clips, texts, pause_s=(0.5, 1.5))
    truth = []
    for (a, _), clip in zip(speech.spans, clips, strict=True):
        e0, e1 = asr_audio.voiced_edges(clip)
        truth.append(((a + e0) / asr_audio.RATE, (a + e1) / asr_audio.RATE))
    detectors = {
        "silero (onnx)": vad.SileroVad(),
        "webrtcvad (mode 2)": vad.WebRtcVad(2),
        "webrtcvad (mode 3)": vad.WebRtcVad(3),
    }
    print(f"{speech.seconds:.1f} s of the embedded voice, {len(clips)} clips, pauses 0.5-1.5 s")
    print(
        f"{'condition':8} {'detector':20} {'true':>4} {'found':>5} {'missed':>6} "
        f"{'median ms':>9} {'p90 ms':>7} {'ms / audio min':>14}"
    )
    for condition, audio in (
        ("clean", speech.samples),
        (f"{args.snr:g} dB", asr_audio.add_noise(speech.samples, args.snr)),
    ):
        for name, detector in detectors.items():
            t = time.perf_counter()
            found = vad.segment_speech(audio, detector, vad.SegmenterOptions(pad_s=0.0))
            cost = (time.perf_counter() - t) / (speech.seconds / 60) * 1000
            s = _score(speech, truth, found)
            print(
                f"{condition:8} {name:20} {s['true']:4d} {s['found']:5d} {s['missed']:6d} "
                f"{s['median_ms']:9.0f} {s['p90_ms']:7.0f} {cost:14.1f}"
            )


if __name__ == "__main__":
    main()
