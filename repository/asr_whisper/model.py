"""Recognizer stage: Whisper tiny.en over the segmenter's windows, streamed a batch at a time.

The first chunk is the transcript's header ({"language", "duration"}); then one
{"segments": [...]} chunk per batch of windows, in order, as each batch is decoded. The
recognizer is `omni_server.audio.whisper.Recognizer`, the same code the tools' WER judge hears
with."""

from __future__ import annotations

from collections.abc import Iterator

from omni_server.audio import whisper
from omni_server.backend import Payload, Request, StageBackend, StageConfigError, StageContext


class WhisperStage(StageBackend):
    def initialize(self, context: StageContext) -> None:
        p = context.parameters
        descriptor = context.stage_dir / "stage.toml"
        threads, batch = p.get("cpu_threads", 2), p.get("batch_size", 4)
        beam = p.get("beam_size", whisper.SERVED_BEAM_SIZE)
        for name, value, most in (
            ("cpu_threads", threads, None),
            ("batch_size", batch, None),
            ("beam_size", beam, whisper.MAX_BEAM_SIZE),
        ):
            bad = isinstance(value, bool) or not isinstance(value, int) or value < 1
            if bad or (most is not None and value > most):
                bound = f"in [1, {most}]" if most is not None else ">= 1"
                raise StageConfigError(
                    f"{descriptor}: parameters.{name} must be an integer {bound}, found {value!r}"
                )
        compute_type = p.get("compute_type", "int8")
        if compute_type not in ("int8", "float32", "int8_float32"):
            raise StageConfigError(
                f'{descriptor}: parameters.compute_type must be "int8", "int8_float32" or '
                f'"float32" on CPU, found {compute_type!r}'
            )
        model = whisper.load_whisper(cpu_threads=threads, compute_type=compute_type)
        self.recognizer = whisper.Recognizer(model, batch_size=batch, beam_size=beam)

    def generate(self, request: Request) -> Iterator[Payload]:
        inputs = request.inputs
        yield {"language": whisper.LANGUAGE, "duration": float(inputs["duration"])}
        raw = inputs.get("options") or {}
        options = whisper.DecodeOptions(
            prompt=raw.get("prompt"),
            temperature=float(raw.get("temperature", 0.0)),
            words=bool(raw.get("words", False)),
        )
        for segments in self.recognizer.windows(inputs["audio"], inputs["windows"], options):
            request.check_aborted()
            yield {"segments": segments}
