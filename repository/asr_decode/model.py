"""Decode stage: an uploaded file (any container PyAV reads) -> 16 kHz mono float32 samples.

A file that is not audio, is corrupt or truncated, or is longer than `max_audio_seconds` is not
a failure of the pipeline but of the request: that request fails with `InvalidRequest`
(code `invalid_audio`, param `file`), which the endpoint answers with a 400 and the message.

Inputs:  {"file": bytes, "options": {...}}     (options pass through to the recognizer)
Output:  {"audio": float32[n], "duration": s, "options"}
"""

from __future__ import annotations

import io

import av
import numpy as np

from omni_server.audio.resample import StreamResampler
from omni_server.backend import (
    InvalidRequest,
    Payload,
    Request,
    StageBackend,
    StageConfigError,
    StageContext,
)

RATE = 16_000
# A container that declares a duration but decodes to much less was cut short (a truncated mp3
# or ogg decodes without an error up to the cut).
TRUNCATED_FRACTION = 0.9
TRUNCATED_SLACK_S = 0.2


class Rejected(ValueError):
    """The upload is not usable audio; the message is for the client."""


class DecodeUpload(StageBackend):
    def initialize(self, context: StageContext) -> None:
        limit = context.parameters.get("max_audio_seconds", 1800)
        if isinstance(limit, bool) or not isinstance(limit, int | float) or limit <= 0:
            raise StageConfigError(
                f"parameters.max_audio_seconds must be a positive number, found {limit!r}"
            )
        self.max_seconds = float(limit)

    def execute(self, requests: list[Request]) -> list[Payload | Exception]:
        outputs: list[Payload | Exception] = []
        for request in requests:
            data = request.inputs.get("file")
            if not isinstance(data, bytes | bytearray):
                outputs.append(ValueError("input 'file' must be the upload's bytes"))
                continue
            options = request.inputs.get("options", {})
            try:
                audio = self.decode(bytes(data))
            except Rejected as rejected:
                outputs.append(InvalidRequest(str(rejected), code="invalid_audio", param="file"))
                continue
            outputs.append({"audio": audio, "duration": audio.size / RATE, "options": options})
        return outputs

    def decode(self, data: bytes) -> np.ndarray:
        if not data:
            raise Rejected("the uploaded file is empty")
        try:
            with av.open(io.BytesIO(data), mode="r") as container:
                if not container.streams.audio:
                    raise Rejected("the uploaded file has no audio stream")
                stream = container.streams.audio[0]
                declared = container.duration / 1e6 if container.duration else None
                audio = self._samples(container, stream)
        except av.error.FFmpegError as err:
            raise Rejected(
                f"the uploaded file could not be decoded as audio ({_reason(err)}); "
                "send wav, mp3, ogg/opus, flac, m4a/aac or webm"
            ) from None
        seconds = audio.size / RATE
        if declared is not None and seconds < declared * TRUNCATED_FRACTION - TRUNCATED_SLACK_S:
            raise Rejected(
                f"the uploaded file is truncated or corrupt: it declares {declared:.2f} s "
                f"of audio but only {seconds:.2f} s could be decoded"
            )
        return audio

    def _samples(self, container, stream) -> np.ndarray:
        rate = stream.codec_context.sample_rate or RATE
        # PyAV downmixes to mono float at the source rate; soxr does the rate change.
        to_mono = av.AudioResampler(format="flt", layout="mono", rate=rate)
        resampler = StreamResampler(rate, RATE)
        parts, samples = [], 0
        limit = int(self.max_seconds * rate)
        for frame in container.decode(stream):
            for mono in to_mono.resample(frame):
                block = mono.to_ndarray().reshape(-1)
                samples += block.size
                if samples > limit:
                    raise Rejected(
                        f"the audio is longer than this server's limit of {self.max_seconds:g} s"
                    )
                parts.append(resampler.push(block))
        for mono in to_mono.resample(None):
            parts.append(resampler.push(mono.to_ndarray().reshape(-1)))
        parts.append(resampler.flush())
        return np.concatenate(parts).astype(np.float32, copy=False)


def _reason(err: av.error.FFmpegError) -> str:
    return getattr(err, "strerror", None) or type(err).__name__
