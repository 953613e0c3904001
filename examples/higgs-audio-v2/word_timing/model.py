"""Word timing (terminal, after the vocoder): the audio forced-aligned to its text as it streams.

Reads the vocoder's chunks ({"audio": body bytes, "samples": float32, "sample_rate"}, the first
with "text", the last with "result"), sends each chunk's audio on at once, and adds under
"timing" (`SpeechTiming`) the words placed since the chunk before: a segment's words once the
pause after it is there, the rest with the last chunk (omni_server.audio.forced_alignment).
Times are the utterance's (seconds from its first sample, after speed and resampling), so a
chunk's timing may be of words whose audio went out in earlier chunks. Result: the vocoder's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from omni_server.audio.forced_alignment import Segmenting, StreamAligner, WhisperAligner
from omni_server.backend import Request, StageBackend, StageConfigError, StageContext
from omni_server.contracts import SpeechTiming

log = logging.getLogger("omni_server.examples.higgs.word_timing")

SEGMENTING = ("min_segment_s", "max_segment_s", "min_pause_s", "silence_db")


class WordTiming(StageBackend):
    def initialize(self, context: StageContext) -> None:
        params = context.parameters
        threads = params.get("cpu_threads", 1)
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise StageConfigError(
                f"parameters.cpu_threads must be an integer >= 1; got {threads!r}"
            )
        values = {k: params[k] for k in SEGMENTING if k in params}
        for key, value in values.items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise StageConfigError(f"parameters.{key} must be a number; got {value!r}")
        try:
            self.segmenting = Segmenting(**{k: float(v) for k, v in values.items()})
        except ValueError as err:
            raise StageConfigError(f"parameters: {err}") from err
        self.aligner = WhisperAligner(cpu_threads=threads)

    def generate(self, request: Request) -> Iterator[dict[str, Any]]:
        stream: StreamAligner | None = None
        result: dict[str, Any] = {}
        for chunk in request.stream():
            if stream is None:
                stream = StreamAligner(
                    self.aligner, chunk["text"], int(chunk["sample_rate"]), self.segmenting
                )
            timings = [stream.push(chunk["samples"])]
            if "result" in chunk:  # the vocoder's last chunk: the words left, and its result
                timings.append(stream.finish())
                result = chunk["result"]
            out: dict[str, Any] = {"audio": chunk["audio"]}
            placed = [t for t in timings if t is not None]
            if placed:
                out[SpeechTiming.KEY] = SpeechTiming.joined(placed)
            if out["audio"] or placed:
                yield out
        if stream is not None and not result:  # ended without the vocoder's last chunk
            timing = stream.finish()
            if timing is not None:
                yield {"audio": b"", SpeechTiming.KEY: timing}
        if stream is not None:
            log.debug("word_timing %s: %d segments aligned in %.3f s", request.id,
                      stream.segments, stream.align_seconds)  # fmt: skip
        return result
