"""Decode stage: an uploaded file (any container PyAV reads) -> 16 kHz mono float32 samples.

A file that is not audio, is corrupt or truncated, or is longer than `max_audio_seconds` is not
a failure of the pipeline but of the request: that request fails with `InvalidRequest`
(code `invalid_audio`, param `file`), which the endpoint answers with a 400 and the message.

Memory is bounded per request and per process (docs/asr.md): the samples are written as they
are decoded into one array (`BudgetedSamples`), at most `max_audio_seconds` of them, and the
decoded audio of every request this process still holds (here and in the stages after) is at
most `max_total_audio_seconds`; a request that would cross that total is refused with code
`rate_limit_exceeded` (the endpoint's 429, `Retry-After`), taking nothing.

Inputs:  {"file": bytes, "options": AsrOptions}   (contracts.AsrOptions: passed on, unread)
Output:  {"audio": float32[n], "duration": s, "options"}
"""

from __future__ import annotations

import io

import av
import numpy as np

from omni_server.audio.budget import BudgetedSamples, BudgetExhausted, SampleBudget
from omni_server.audio.containers import cut_short, plain_wav
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
FIRST_CAPACITY_S = 120.0  # the buffer's first size when the container declares no duration
RESAMPLER_SLACK = RATE  # the resampler's tail may add a few samples past the input's length


class Rejected(ValueError):
    """The upload is not usable audio; the message is for the client."""


class DecodeUpload(StageBackend):
    def initialize(self, context: StageContext) -> None:
        self.max_seconds = _seconds(context.parameters, "max_audio_seconds", 1800)
        total = _seconds(context.parameters, "max_total_audio_seconds", 3600)
        if total < self.max_seconds:
            raise StageConfigError(
                f"parameters.max_total_audio_seconds ({total:g}) must be at least "
                f"parameters.max_audio_seconds ({self.max_seconds:g}): one request of the "
                "longest audio allowed must fit"
            )
        self.total_seconds = total
        self.budget = SampleBudget(int(total * RATE) + RESAMPLER_SLACK)

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
            except BudgetExhausted:
                held = self.budget.held / RATE
                outputs.append(
                    InvalidRequest(
                        "the server is holding as much decoded audio as it allows "
                        f"({self.total_seconds:g} s across requests, {held:.0f} s held now); "
                        "retry when some finish",
                        code="rate_limit_exceeded",
                    )
                )
                continue
            outputs.append({"audio": audio, "duration": audio.size / RATE, "options": options})
        return outputs

    def decode(self, data: bytes) -> np.ndarray:
        if not data:
            raise Rejected("the uploaded file is empty")
        plain = plain_wav(data)
        if plain is not None:  # mono PCM16 WAV, whole: no FFmpeg needed (the same samples)
            return self._pcm16(*plain)
        try:
            with av.open(io.BytesIO(data), mode="r") as container:
                if not container.streams.audio:
                    raise Rejected("the uploaded file has no audio stream")
                stream = container.streams.audio[0]
                # FFmpeg opens a header it cannot decode (a WAV of 255 bits per sample, an
                # unknown format tag) with no decoder and no rate: refuse it by name
                codec = stream.codec_context
                if codec is None or not codec.sample_rate:
                    raise Rejected(
                        "the uploaded file's audio stream has no decodable format "
                        f"({_describe(stream)}); send wav, mp3, ogg/opus, flac, m4a/aac or webm"
                    )
                declared = container.duration / 1e6 if container.duration else None
                audio = self._samples(container, stream, codec.sample_rate, declared)
                name = str(container.format.name)
        except av.error.FFmpegError as err:
            raise Rejected(
                f"the uploaded file could not be decoded as audio ({_reason(err)}); "
                "send wav, mp3, ogg/opus, flac, m4a/aac or webm"
            ) from None
        # the one completeness check of uploads (a voice's clip is checked alike)
        cut = cut_short(data, name, declared, audio.size / RATE)
        if cut is not None:
            raise Rejected(f"the uploaded file is truncated or corrupt: {cut}")
        return audio

    def _pcm16(self, pcm: np.ndarray, rate: int) -> np.ndarray:
        """A plain WAV's samples as FFmpeg's path gives them: x / 32768, then soxr to 16 kHz."""
        if pcm.size > int(self.max_seconds * rate):
            raise Rejected(
                f"the audio is longer than this server's limit of {self.max_seconds:g} s"
            )
        out = BudgetedSamples(
            self.budget,
            capacity_limit=int(self.max_seconds * RATE) + RESAMPLER_SLACK,
            expected=int(pcm.size * RATE / rate) + RESAMPLER_SLACK,
        )
        resampler = StreamResampler(rate, RATE)
        out.append(resampler.push(pcm.astype(np.float32) * np.float32(1 / 32768)))
        out.append(resampler.flush())
        return out.finish()

    def _samples(self, container, stream, rate: int, declared: float | None) -> np.ndarray:
        # PyAV downmixes to mono float at the source rate; soxr does the rate change.
        to_mono = av.AudioResampler(format="flt", layout="mono", rate=rate)
        resampler = StreamResampler(rate, RATE)
        expected = min(declared, self.max_seconds) if declared else FIRST_CAPACITY_S
        out = BudgetedSamples(
            self.budget,
            capacity_limit=int(self.max_seconds * RATE) + RESAMPLER_SLACK,
            expected=int(expected * RATE) + RESAMPLER_SLACK,
        )
        seen, limit = 0, int(self.max_seconds * rate)
        for frame in container.decode(stream):
            for mono in to_mono.resample(frame):
                block = mono.to_ndarray().reshape(-1)
                seen += block.size
                if seen > limit:
                    raise Rejected(
                        f"the audio is longer than this server's limit of {self.max_seconds:g} s"
                    )
                out.append(resampler.push(block))
        for mono in to_mono.resample(None):
            out.append(resampler.push(mono.to_ndarray().reshape(-1)))
        out.append(resampler.flush())
        return out.finish()


def _seconds(parameters, name: str, default: float) -> float:
    value = parameters.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise StageConfigError(f"parameters.{name} must be a positive number, found {value!r}")
    return float(value)


def _describe(stream) -> str:
    tag = getattr(stream, "codec_tag", None)
    name = stream.codec_context.name if stream.codec_context is not None else None
    return f"codec {name or 'unknown'}" + (f", tag {tag!r}" if tag else "")


def _reason(err: av.error.FFmpegError) -> str:
    return getattr(err, "strerror", None) or type(err).__name__
