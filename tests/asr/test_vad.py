"""The voice-activity segmenter: detectors, the utterance tracker, window packing."""

from __future__ import annotations

import numpy as np
import pytest

from omni_bench import asr_audio
from omni_server.audio import vad

FRAME_S = 0.032


def _utterances(pattern: str, **options) -> list[vad.Utterance]:
    """Utterances of a frame pattern: '#' speech (p=0.9), '.' silence (p=0.05)."""
    probs = [0.9 if ch == "#" else 0.05 for ch in pattern]
    return vad.utterances_from(probs, FRAME_S, vad.SegmenterOptions(**options))


def test_two_bursts_split_by_a_long_pause_are_two_utterances():
    pattern = "." * 10 + "#" * 30 + "." * 20 + "#" * 30 + "." * 10
    found = _utterances(pattern, pad_s=0.0, min_silence_s=0.3)
    assert [(round(u.start / FRAME_S), round(u.end / FRAME_S)) for u in found] == [
        (10, 40),
        (60, 90),
    ]


def test_a_short_pause_does_not_split():
    pattern = "#" * 30 + "." * 5 + "#" * 30  # 0.16 s < min_silence 0.3 s
    assert len(_utterances(pattern, pad_s=0.0)) == 1


def test_a_click_shorter_than_min_speech_is_dropped():
    assert _utterances("." * 20 + "##" + "." * 20, min_speech_s=0.1, pad_s=0.0) == []


def test_padding_never_overlaps_the_previous_utterance_nor_leaves_the_audio():
    pattern = "#" * 20 + "." * 10 + "#" * 20
    found = _utterances(pattern, pad_s=0.5, min_silence_s=0.3)
    assert len(found) == 2
    assert found[0].start == 0.0
    assert found[0].end <= found[1].start
    assert found[1].end <= len(pattern) * FRAME_S + 1e-9


def test_a_long_stretch_is_cut_at_its_longest_pause():
    # 40 speech, a 3-frame pause, 40 speech, a 6-frame pause, 60 speech: 4.8 s > max 4 s
    pattern = "#" * 40 + "..." + "#" * 40 + "......" + "#" * 60
    found = _utterances(pattern, pad_s=0.0, min_silence_s=1.0, max_utterance_s=4.0)
    assert len(found) >= 2
    assert all(u.end - u.start <= 4.0 + 1e-9 for u in found)
    # the first cut falls in the longer (6-frame) pause
    assert round(found[0].end / FRAME_S) == 83


def test_the_tracker_reports_speech_start_at_once():
    tracker = vad.UtteranceTracker(FRAME_S)
    assert tracker.push(0.05) == []
    events = tracker.push(0.9)
    assert events == [vad.SpeechStarted(FRAME_S)]


def test_silero_streaming_gives_the_batch_probabilities(paused):
    audio = paused.samples[: 16000 * 6]
    batch = vad.SileroVad().probabilities(audio)
    stream = vad.SileroVad().stream()
    pieces, at, rng = [], 0, np.random.default_rng(0)
    while at < audio.size:
        n = int(rng.integers(100, 3000))
        pieces.append(stream.push(audio[at : at + n]))
        at += n
    live = np.concatenate(pieces)
    whole = audio.size // vad.SileroVad.frame_samples
    np.testing.assert_allclose(live[:whole], batch[:whole], atol=1e-5)


@pytest.mark.parametrize("detector", [vad.SileroVad(), vad.WebRtcVad(3)], ids=["silero", "webrtc"])
def test_each_clip_of_speech_with_pauses_is_one_utterance(paused, clips, detector):
    found = vad.segment_speech(paused.samples, detector, vad.SegmenterOptions(pad_s=0.0))
    assert len(found) == len(clips)
    for u, (a, _), clip in zip(found, paused.spans, clips, strict=True):
        e0, e1 = asr_audio.voiced_edges(clip)
        true_start, true_end = (a + e0) / 16000, (a + e1) / 16000
        assert abs(u.start - true_start) < 0.2, (u, true_start)
        assert abs(u.end - true_end) < 0.3, (u, true_end)


def test_silence_and_noise_floor_have_no_utterance():
    quiet = (np.random.default_rng(0).standard_normal(16000 * 3) * 1e-4).astype(np.float32)
    assert vad.segment_speech(quiet) == []
    assert vad.segment_speech(np.zeros(0, np.float32)) == []


def test_windows_pack_utterances_in_order_within_the_limit():
    utterances = [vad.Utterance(float(i * 7), float(i * 7 + 5)) for i in range(10)]
    windows = vad.pack_windows(utterances, max_seconds=30.0)
    assert all(e - s <= 30.0 for s, e in windows)
    assert windows == sorted(windows)
    for u in utterances:  # every utterance lies inside exactly one window
        assert sum(s <= u.start and u.end <= e for s, e in windows) == 1
    assert len(windows) == 3  # 5 s utterances every 7 s: four to a 30 s window
