"""The recognizer the ASR stage serves with and the WER judge hears with (real Whisper tiny.en)."""

from __future__ import annotations

import numpy as np
import pytest

from omni_bench import asr_audio
from omni_bench.wer import word_error_rate
from omni_server.audio import vad, whisper

pytestmark = pytest.mark.slow  # loads Whisper and runs it on CPU


@pytest.fixture(scope="module")
def recognizer() -> whisper.Recognizer:
    return whisper.Recognizer(whisper.load_whisper(), batch_size=4)


def _windows(audio: np.ndarray) -> list[tuple[float, float]]:
    return vad.pack_windows(vad.segment_speech(audio))


def test_speech_with_pauses_is_heard_in_time_order(recognizer, paused):
    segments = [
        s for batch in recognizer.windows(paused.samples, _windows(paused.samples)) for s in batch
    ]
    assert word_error_rate([paused.text], [" ".join(s["text"] for s in segments)]) <= 0.1
    starts = [s["start"] for s in segments]
    assert starts == sorted(starts)
    assert all(0 <= s["start"] < s["end"] <= paused.seconds + 0.05 for s in segments)
    assert all(s["words"] == [] for s in segments)  # not asked for


def test_segments_are_sentences_with_their_words_when_asked(recognizer, paused):
    options = whisper.DecodeOptions(words=True)
    segments = [
        s for b in recognizer.windows(paused.samples, _windows(paused.samples), options) for s in b
    ]
    assert len(segments) >= 4  # one sentence per clip at least
    for segment in segments:
        assert segment["words"]
        assert segment["start"] == segment["words"][0]["start"]
        assert segment["end"] == segment["words"][-1]["end"]
        assert " ".join(w["word"] for w in segment["words"]) == segment["text"]
        assert segment["tokens"]


def test_batches_come_out_in_order_the_first_holding_one_window(recognizer, clips):
    long = asr_audio.join_with_pauses(clips * 4, ["x"] * 16, pause_s=(1.0, 2.0), seed=5)
    windows = _windows(long.samples)
    assert len(windows) >= 3
    batches = list(recognizer.windows(long.samples, windows))
    first_window = windows[0]
    assert batches[0] and all(
        first_window[0] - 0.01 <= s["start"] < first_window[1] for s in batches[0]
    )
    starts = [s["start"] for b in batches for s in b]
    assert starts == sorted(starts)
    assert len(batches) >= 2


def test_a_window_whisper_leaves_early_is_heard_to_its_end(recognizer):
    """Three short sentences with brief pauses make one window in which tiny.en ends after the
    second sentence (seen with this voice and seed); the resume decodes the third."""
    text = (
        "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
        "with a single step. Bright stars shine over the quiet harbor tonight."
    )
    audio = asr_audio.VoiceSynth().say(text)
    windows = _windows(audio)
    assert len(windows) == 1
    heard = " ".join(s["text"] for b in recognizer.windows(audio, windows) for s in b)
    assert word_error_rate([text], [heard]) <= 0.15, heard
    assert "harbor" in heard.lower()


def test_silence_has_no_window_and_no_segment(recognizer):
    silence = np.zeros(16000 * 2, np.float32)
    assert list(recognizer.windows(silence, _windows(silence))) == []
    assert recognizer.transcribe(silence, 16000) == ""


def test_the_judges_transcribe_is_the_stage_path(recognizer, paused):
    judged = recognizer.transcribe(paused.samples, 16000)
    staged = whisper.join_text(
        [s["text"] for b in recognizer.windows(paused.samples, _windows(paused.samples)) for s in b]
    )
    assert judged == staged
