"""Which windows of which clips share a recognizer call, and in what order each clip's segments
come out (omni_server.audio.window_batch; no Whisper: calls are played by hand)."""

from __future__ import annotations

import numpy as np
import pytest

from omni_server.audio.whisper import DecodeOptions
from omni_server.audio.window_batch import Transcription, Window, plan_batch

RATE = 16_000


def _clip(seconds: float, windows: list[tuple[float, float]], **options) -> Transcription:
    audio = np.zeros(int(seconds * RATE), dtype=np.float32)
    return Transcription(audio, windows, DecodeOptions(**options), most=4)


def _segment(window: Window, text: str) -> dict:
    return {"start": window.start, "end": window.end, "text": text}


def _hear_all(batch: list[Window]) -> None:
    """Play one call in which every window is heard to its end."""
    by_owner: dict[int, list] = {}
    for w in batch:
        by_owner.setdefault(id(w.owner), []).append((w, [_segment(w, f"w{w.slot}")], None))
    for w in dict.fromkeys(w.owner for w in batch):
        w.settle(by_owner[id(w)])


def test_a_clips_calls_hold_one_window_then_double_up_to_its_most():
    clip = _clip(300, [(i * 30.0, i * 30.0 + 29) for i in range(10)])
    sizes, texts = [], []
    while clip.pending:
        batch = plan_batch([clip], 8)
        sizes.append(len(batch))
        _hear_all(batch)
        assert not clip.finished  # not until its segments are handed out
        texts += [s["text"] for s in clip.ready()]
    assert sizes == [1, 2, 4, 3]
    assert texts == [f"w{i}" for i in range(10)]
    assert clip.finished


def test_windows_of_several_clips_share_a_call_round_robin_oldest_first():
    long = _clip(300, [(i * 30.0, i * 30.0 + 29) for i in range(10)])
    long.took()
    long.took()  # as after two calls: it may put 4 windows in the next
    short = [_clip(5, [(0.2, 4.8)]) for _ in range(3)]
    batch = plan_batch([long, *short], 5)
    # one window each round: the long file's first, each short clip's, then the long file's
    assert [(w.owner, w.slot) for w in batch] == [
        (long, 0),
        (short[0], 0),
        (short[1], 0),
        (short[2], 0),
        (long, 1),
    ]
    assert long.pending == 8 and not any(s.pending for s in short)


def test_a_call_never_mixes_prompts_or_temperatures():
    plain = _clip(5, [(0.0, 4.0)])
    prompted = _clip(5, [(0.0, 4.0)], prompt="Acme Corp.")
    warm = _clip(5, [(0.0, 4.0)], temperature=0.4)
    other_plain = _clip(5, [(0.0, 4.0)], words=True)  # words do not change the call
    first = plan_batch([prompted, plain, warm, other_plain], 8)
    assert {w.owner for w in first} == {prompted}
    second = plan_batch([prompted, plain, warm, other_plain], 8)
    assert {w.owner for w in second} == {plain, other_plain}
    assert {w.owner for w in plan_batch([plain, warm, other_plain], 8)} == {warm}


def test_segments_come_out_in_window_order_a_resumed_window_first():
    clip = _clip(100, [(0.0, 29.0), (30.0, 59.0), (60.0, 89.0)])
    clip.took()
    clip.took()
    batch = plan_batch([clip], 8)
    assert [w.slot for w in batch] == [0, 1, 2]
    first, second, third = batch
    rest = Window(clip, 0, 20.0, 29.0, resumes=1)  # Whisper stopped at 20 s in window 0
    clip.settle(
        [
            (first, [_segment(first, "a")], rest),
            (second, [_segment(second, "b")], None),
            (third, [_segment(third, "c")], None),
        ]
    )
    assert clip.ready() == []  # window 0 is not heard to its end: nothing after it goes out
    again = plan_batch([clip], 8)
    assert again == [rest]
    clip.settle([(rest, [_segment(rest, "a2")], None)])
    assert [s["text"] for s in clip.ready()] == ["a", "a2", "b", "c"]
    assert clip.finished and clip.ready() == []


def test_settle_refuses_another_clips_window():
    mine, theirs = _clip(5, [(0.0, 4.0)]), _clip(5, [(0.0, 4.0)])
    (window,) = plan_batch([theirs], 8)
    with pytest.raises(ValueError, match="another clip"):
        mine.settle([(window, [], None)])


def test_windows_past_the_audio_are_cut_and_silence_is_finished_at_once():
    clip = _clip(10, [(2.0, 14.0), (12.0, 20.0)])  # the second lies past the audio's end
    (window,) = plan_batch([clip], 8)
    assert (window.start, window.end) == (2.0, 10.0)
    assert not clip.pending
    silent = _clip(10, [])
    assert silent.finished and not silent.pending and plan_batch([silent], 8) == []
