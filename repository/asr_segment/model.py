"""Segment stage: 16 kHz audio -> its utterances (voice activity) packed into Whisper windows.

The segmenter is `omni_server.audio.vad` (Silero VAD v6 on onnxruntime; docs/asr.md says why
Silero over webrtcvad), the same module a realtime turn detector uses. Silence gives no window:
the recognizer then has nothing to hear and the transcript is empty.

Output: {"audio", "duration", "options", "windows": [(start s, end s), ...]}.
"""

from __future__ import annotations

from omni_server.audio import vad
from omni_server.backend import Payload, Request, StageBackend, StageConfigError, StageContext


class SegmentSpeech(StageBackend):
    def initialize(self, context: StageContext) -> None:
        p = context.parameters
        try:
            self.options = vad.SegmenterOptions(
                threshold=float(p.get("threshold", 0.5)),
                min_silence_s=float(p.get("min_silence_s", 0.3)),
                pad_s=float(p.get("pad_s", 0.2)),
                max_utterance_s=float(p.get("window_seconds", 30.0)) - 1.0,
            )
            self.window_s = float(p.get("window_seconds", 30.0))
        except (TypeError, ValueError) as err:
            raise StageConfigError(f"parameters must be numbers: {err}") from None
        if not 0 < self.options.threshold < 1:
            raise StageConfigError(
                f"parameters.threshold must be in (0, 1), found {self.options.threshold}"
            )
        if not 2.0 <= self.window_s <= 30.0:
            raise StageConfigError(
                f"parameters.window_seconds must be in [2, 30] (Whisper hears 30 s), "
                f"found {self.window_s}"
            )
        self.detector = vad.SileroVad()

    def execute(self, requests: list[Request]) -> list[Payload | Exception]:
        outputs: list[Payload | Exception] = []
        for request in requests:
            inputs = request.inputs
            utterances = vad.segment_speech(inputs["audio"], self.detector, self.options)
            windows = vad.pack_windows(utterances, self.window_s)
            outputs.append({**inputs, "windows": windows})
        return outputs
