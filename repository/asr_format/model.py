"""Transcript stage (terminal): recognized segments -> text deltas, then the whole transcript.

Reads the recognizer's stream: a header chunk, then batches of segments. For each batch it
yields {"text": delta} (the batch's text, with a joining space after the first; and, when the
request asked for them, "logprobs": the batch's tokens with their log-probabilities), which the
endpoint streams as `transcript.text.delta`; its result is the transcript every response format
is made from:

    {"text", "language", "duration", "segments": [{"id", "start", "end", "text", "tokens",
     "avg_logprob", "compression_ratio", "no_speech_prob", "words", "logprobs"?}]}
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from omni_server.backend import Payload, Request, StageBackend


class TranscriptStage(StageBackend):
    def generate(self, request: Request) -> Iterator[Payload]:
        header: dict[str, Any] | None = None
        segments: list[dict[str, Any]] = []
        text = ""
        for chunk in request.stream():
            if header is None:
                header = chunk
                continue
            batch = [s for s in chunk["segments"] if s["text"]]
            delta = " ".join(s["text"] for s in batch)
            if not delta:
                continue
            if text:
                delta = " " + delta
            text += delta
            for segment in batch:
                segments.append({"id": len(segments), **segment})
            chunk_out: Payload = {"text": delta}
            if all("logprobs" in s for s in batch):
                chunk_out["logprobs"] = [lp for s in batch for lp in s["logprobs"]]
            yield chunk_out
        if header is None:
            raise RuntimeError("the recognizer's stream ended without its header chunk")
        return {
            "text": text,
            "language": header["language"],
            "duration": header["duration"],
            "segments": segments,
        }
