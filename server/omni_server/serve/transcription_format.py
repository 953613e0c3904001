"""A transcript (the ASR pipeline's result) in OpenAI's response formats.

    json          {"text", "logprobs"?, "usage": {"type": "duration", "seconds"}}
                  (logprobs: with include[]=logprobs, [{"token", "logprob", "bytes"}])
    text          the text, a newline at the end
    srt / vtt     one cue per segment (SubRip: "HH:MM:SS,mmm"; WebVTT: "HH:MM:SS.mmm")
    verbose_json  {"task", "language", "duration", "text", "segments"?, "words"?, "usage"}

The transcript is the terminal stage's result: {"text", "language", "duration", "segments"}
with each segment {"id", "start", "end", "text", "tokens", "avg_logprob", "compression_ratio",
"no_speech_prob", "words", "logprobs"?}.
"""

from __future__ import annotations

import json
import math
from typing import Any

LANGUAGE_NAMES = {"en": "english"}  # verbose_json names the language, as OpenAI does

CONTENT_TYPES = {
    "json": "application/json",
    "verbose_json": "application/json",
    "text": "text/plain; charset=utf-8",
    "srt": "application/x-subrip; charset=utf-8",
    "vtt": "text/vtt; charset=utf-8",
}


def usage(transcript: dict[str, Any]) -> dict[str, Any]:
    """Whisper is billed by input duration: whole seconds, rounded up."""
    return {"type": "duration", "seconds": math.ceil(float(transcript["duration"]))}


def render(
    transcript: dict[str, Any],
    response_format: str,
    granularities: tuple[str, ...],
    logprobs: bool = False,
) -> str:
    if response_format == "json":
        body: dict[str, Any] = {"text": transcript["text"]}
        if logprobs:
            body["logprobs"] = token_logprobs(transcript["segments"])
        return _json({**body, "usage": usage(transcript)})
    if response_format == "text":
        return transcript["text"] + "\n"
    if response_format == "srt":
        return srt(transcript["segments"])
    if response_format == "vtt":
        return vtt(transcript["segments"])
    if response_format == "verbose_json":
        return _json(verbose(transcript, granularities))
    raise ValueError(f"unknown response_format {response_format!r}")


def token_logprobs(segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's `logprobs` of a transcript: every segment's tokens, in order."""
    return [lp for s in segments for lp in s.get("logprobs", ())]


def verbose(transcript: dict[str, Any], granularities: tuple[str, ...]) -> dict[str, Any]:
    language = transcript["language"]
    body: dict[str, Any] = {
        "task": "transcribe",
        "language": LANGUAGE_NAMES.get(language, language),
        "duration": round(float(transcript["duration"]), 3),
        "text": transcript["text"],
    }
    if "segment" in granularities:
        body["segments"] = [_segment(s) for s in transcript["segments"]]
    if "word" in granularities:
        body["words"] = [
            {"word": w["word"], "start": round(w["start"], 3), "end": round(w["end"], 3)}
            for s in transcript["segments"]
            for w in s["words"]
        ]
    body["usage"] = usage(transcript)
    return body


def _segment(s: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": s["id"],
        "seek": 0,
        "start": round(s["start"], 3),
        "end": round(s["end"], 3),
        "text": " " + s["text"],  # OpenAI's segments keep Whisper's leading space
        "tokens": s["tokens"],
        "temperature": s.get("temperature", 0.0),
        "avg_logprob": s["avg_logprob"],
        "compression_ratio": s["compression_ratio"],
        "no_speech_prob": s["no_speech_prob"],
    }


def srt(segments: list[dict[str, Any]]) -> str:
    cues = [
        f"{i}\n{_clock(s['start'], ',')} --> {_clock(s['end'], ',')}\n{s['text']}\n"
        for i, s in enumerate(segments, start=1)
    ]
    return "\n".join(cues)


def vtt(segments: list[dict[str, Any]]) -> str:
    cues = [
        f"{_clock(s['start'], '.')} --> {_clock(s['end'], '.')}\n{s['text']}\n" for s in segments
    ]
    return "\n".join(["WEBVTT\n", *cues])


def _clock(seconds: float, separator: str) -> str:
    ms = max(0, round(seconds * 1000))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{ms:03d}"


def _json(body: dict[str, Any]) -> str:
    return json.dumps(body, ensure_ascii=False)
