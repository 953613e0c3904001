"""The forced aligner (omni_server.audio.forced_alignment, the word_timing stage's) on real
speech: the embedded Piper voice speaks held-out texts (tools/omni_bench/data/heldout.txt, never
used to tune the aligner) and times its words itself from VITS's durations; the aligner, fed
the voice's chunks as they come, must time every word of the text, in order, near the voice's
own times, and cut the stream where it would cut it whole.

The bounds are what Whisper tiny.en's alignment reaches (docs/models.md, "Word timing"), with a
margin: `python -m omni_bench.word_alignment` prints the full table (speeds 0.5, 1 and 2, and
Whisper's transcription timestamps for comparison)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from omni_bench.speech import load_dataset
from omni_server.audio import decode
from omni_server.audio.align_text import spoken_words
from omni_server.audio.forced_alignment import StreamAligner, WhisperAligner
from omni_server.backend import Request
from omni_server.contracts import SpeechTiming

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HELD_OUT = Path(__file__).resolve().parents[2] / "tools" / "omni_bench" / "data" / "heldout.txt"
RATE = 24_000  # the body's (pcm's default rate), as a vocoder would send it
MEDIAN_S, P95_S = 0.08, 0.30  # word starts against the voice's own (see the module docstring)


@pytest.fixture(scope="module")
def aligner() -> WhisperAligner:
    return WhisperAligner(cpu_threads=2)


@pytest.fixture(scope="module")
def spoken(voice) -> list[tuple[list[np.ndarray], SpeechTiming]]:
    """Two held-out utterances of four sentences each: the voice's chunks and its timing."""
    texts = load_dataset(HELD_OUT)
    out = []
    for seed, start in enumerate((0, 4)):
        inputs = voice.request(" ".join(texts[start : start + 4]), seed=seed,
                               response_format="pcm", stream=True)  # fmt: skip
        request = Request(id=f"align{seed}", inputs={}, _stream=voice.sentences(inputs))
        chunks, timings = [], []
        for chunk in voice.encoder.generate(request):
            if chunk.get("audio"):
                chunks.append(decode(chunk["audio"], "pcm").samples)
            if isinstance(chunk.get(SpeechTiming.KEY), SpeechTiming):
                timings.append(chunk[SpeechTiming.KEY])
        out.append((chunks, SpeechTiming.joined(timings)))
    return out


def aligned(aligner: WhisperAligner, text: str, chunks: list[np.ndarray]) -> SpeechTiming:
    stream = StreamAligner(aligner, text, RATE)
    timings = [stream.push(c) for c in chunks]
    timings.append(stream.finish())
    return SpeechTiming.joined([t for t in timings if t is not None])


def test_every_word_is_timed_in_order_near_the_voices_own_times(aligner, spoken) -> None:
    errors = []
    for chunks, truth in spoken:
        timing = aligned(aligner, truth.text, chunks)
        assert timing.text == truth.text
        assert [w.text for w in timing.words] == [w.text for w in spoken_words(truth.text)]
        assert [w.text for w in timing.words] == [w.text for w in truth.words]
        starts = [w.start_s for w in timing.words]
        assert starts == sorted(starts)
        seconds = sum(len(c) for c in chunks) / RATE
        assert all(0 <= w.start_s <= w.end_s <= seconds for w in timing.words)
        errors += [
            abs(a.start_s - b.start_s) for a, b in zip(timing.words, truth.words, strict=True)
        ]
    median, p95 = np.quantile(errors, [0.5, 0.95])
    print(
        f"{len(errors)} words: start error median {1000 * median:.0f} ms, p95 {1000 * p95:.0f} ms"
    )
    assert median <= MEDIAN_S and p95 <= P95_S, (median, p95)


def test_chunking_does_not_move_the_words(aligner, spoken) -> None:
    """The voice's chunks, the audio whole, and 40 ms pieces: the same segments, the same
    times (up to the resampler's arithmetic at other block edges)."""
    chunks, truth = spoken[0]
    audio = np.concatenate(chunks)
    piece = RATE // 25
    ways = [chunks, [audio], [audio[i : i + piece] for i in range(0, len(audio), piece)]]
    times = [[(w.start_s, w.end_s) for w in aligned(aligner, truth.text, c).words] for c in ways]
    assert np.allclose(times[0], times[1], atol=0.002) and np.allclose(
        times[0], times[2], atol=0.002
    )
