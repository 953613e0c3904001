"""A voice's `contracts.SpeechTiming` in each transport's shape: ElevenLabs' alignments (their
WebSocket's milliseconds per chunk, their REST seconds per response) and our word lists.

A terminal speech chunk may carry a timing beside its bytes ("timing"); times are seconds from
the utterance's first sample (contracts.py).
"""

from __future__ import annotations

from typing import Any

from omni_server.contracts import SpeechTiming


def chunk_timing(chunk: Any) -> SpeechTiming | None:
    """The timing a terminal chunk carries, or None (a voice that times nothing)."""
    timing = chunk.get(SpeechTiming.KEY) if isinstance(chunk, dict) else None
    return timing if isinstance(timing, SpeechTiming) else None


def ws_alignment(timing: SpeechTiming, chunk_start_s: float) -> dict[str, Any]:
    """ElevenLabs' WebSocket `alignment`: milliseconds from the start of the audio chunk it
    rides with (`chunk_start_s`, in the utterance's seconds), as their SDK reads it."""
    starts = timing.character_start_times_seconds
    ends = timing.character_end_times_seconds
    return {
        "chars": list(timing.characters),
        "charStartTimesMs": [max(0, round((s - chunk_start_s) * 1000)) for s in starts],
        "charDurationsMs": [round((e - s) * 1000) for s, e in zip(starts, ends, strict=True)],
    }


def rest_alignment(timing: SpeechTiming) -> dict[str, Any]:
    """ElevenLabs' `with-timestamps` `alignment`: seconds from the audio's start."""
    return {
        "characters": list(timing.characters),
        "character_start_times_seconds": [
            round(s, 3) for s in timing.character_start_times_seconds
        ],
        "character_end_times_seconds": [round(e, 3) for e in timing.character_end_times_seconds],
    }


def words(timing: SpeechTiming) -> list[dict[str, Any]]:
    """The words as OpenAI's transcriptions list them: `{"word", "start", "end"}` in seconds."""
    return [
        {"word": w.text, "start": round(w.start_s, 3), "end": round(w.end_s, 3)}
        for w in timing.words
    ]


def words_ms(timing: SpeechTiming) -> list[dict[str, Any]]:
    """The words in milliseconds of the item's audio (realtime's unit, as `audio_end_ms`)."""
    return [
        {"word": w.text, "start_ms": round(w.start_s * 1000), "end_ms": round(w.end_s * 1000)}
        for w in timing.words
    ]
