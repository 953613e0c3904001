"""code2wav (terminal, `kind = "ar"` fed by the talker's frames): frames of G codes -> 24 kHz
audio with Qwen3-Omni's code2wav (models/qwen3_omni/code2wav.py), a chunk at a time, then the
request's rate and format.

Chunks: `first_chunk_frames` frames, then doubling up to `chunk_frames`. The codec is causal but
for its decoder blocks' transposed convolutions, which look one input sample ahead each: a
frame's last samples (a few hundred) need the next frame (`lookahead_frames`, 1). So chunk
[a, b) is decoded as frames [a - context_frames, b + lookahead) and only samples [a, b) * 1920
are kept: with the codec's receptive field inside that window they equal the samples of one
decode of every frame (tests: >= 30 dB against transformers' decode of the whole). The stream's
last chunk runs to its end (the whole decode's length: the last frame's lookahead samples are
missing there too).

Batched across requests: a step takes every stream's new frames (`take_stream()`), then
decodes every due window, those of one length (in frames) in one call, first chunks first.

In (chunks from the talker): {"frames": [[G codes]], the first "speech" (SpeechOptions: format,
rate, stream), the last "finish_reason"}. Out: {"audio": bytes}; result {"sample_rate",
"audio_seconds", "format", "frames", "finish_reason"}; a stream that ends without a chunk
(the thinker said nothing, so the talker did not speak) ends with no audio, finish_reason
"silent".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omni_server.audio.encode import AudioEncoder, default_sample_rate
from omni_server.audio.resample import StreamResampler
from omni_server.backend import (
    Request,
    RequestAborted,
    StageBackend,
    StageConfigError,
    StageContext,
    StepOutput,
)
from omni_server.contracts import SpeechOptions
from omni_server.models.qwen3_omni.code2wav import Code2Wav, lookahead_frames
from omni_server.models.qwen3_omni.folder import CheckpointFolderError, checkpoint_folder

log = logging.getLogger("omni_server.examples.qwen3_omni.code2wav")

SAMPLE_RATE = 24_000
SIZES = (("first_chunk_frames", 4, 1), ("chunk_frames", 32, 1), ("context_frames", 25, 0))


@dataclass(eq=False)
class Stream:
    """One request's audio in the making (opened at its first chunk, which says the format)."""

    request: Request
    encoder: AudioEncoder
    resampler: StreamResampler
    frames: list[list[int]] = field(default_factory=list)
    final: bool = False  # the talker's last frame came
    done: int = 0  # frames whose audio is decoded
    chunks: int = 0  # chunks decoded (their sizes grow)
    ready: list[np.ndarray] = field(default_factory=list)  # decoded, not yet sent
    finish_reason: str | None = None


@dataclass(frozen=True)
class Window:
    stream: Stream
    start: int  # first frame decoded (context included)
    keep: int  # first frame whose samples are kept
    count: int  # frames whose samples are kept
    stop: int  # one past the last frame decoded
    last: bool  # the stream's last window: keep to the decode's end


def stage_dtype(value: Any, device: str) -> torch.dtype:
    if value == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if value not in ("float32", "bfloat16", "float16"):
        raise StageConfigError(
            f'parameters.dtype must be "auto", "float32", "bfloat16" or "float16"; got {value!r}'
        )
    dtype: torch.dtype = getattr(torch, value)
    return dtype


class Code2WavStage(StageBackend):
    def initialize(self, context: StageContext) -> None:
        params = context.parameters
        if context.device == "cpu":
            torch.set_num_threads(int(params.get("intra_op_threads", 1)))
        try:
            folder = checkpoint_folder(context.repository_parameters)
        except CheckpointFolderError as err:
            raise StageConfigError(str(err)) from err
        dtype = stage_dtype(params.get("dtype", "auto"), context.device)
        try:
            self.codec = Code2Wav.from_checkpoint(folder, dtype).to(context.device)
        except (OSError, KeyError, ValueError) as err:
            raise StageConfigError(f"checkpoint {folder}: {err}") from err
        sizes = {}
        for key, default, least in SIZES:
            value = params.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise StageConfigError(
                    f"parameters.{key} must be an integer >= {least}; got {value!r}"
                )
            sizes[key] = value
        self.first, self.chunk = sizes["first_chunk_frames"], sizes["chunk_frames"]
        self.context = sizes["context_frames"]
        self.lookahead = lookahead_frames(self.codec.shape)
        self.spf = self.codec.shape.samples_per_frame
        self.groups = self.codec.shape.num_quantizers
        self.device = context.device
        self._held: dict[int, Request] = {}  # id(request) -> request, from add() to its end
        self._streams: dict[int, Stream] = {}  # id(request) -> its stream, once frames came
        self.decode_calls = 0

    @property
    def live_requests(self) -> int:
        """Requests this stage holds (held or streaming): 0 when all ended or were aborted."""
        return len(self._held.keys() | self._streams.keys())

    # ---- the ar contract (one compute thread: no locks) -----------------------------------

    def add(self, request: Request) -> None:
        self._held[id(request)] = request

    def abort(self, request: Request) -> None:
        self._held.pop(id(request), None)
        stream = self._streams.pop(id(request), None)
        if stream is not None:
            stream.encoder.close()
            log.info("code2wav: stopped %s after %d frames (%d streams running)",
                     request.id, stream.done, len(self._streams))  # fmt: skip

    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        for key, request in list(self._held.items()):
            try:
                silent = self._take(key, request)
            except RequestAborted:
                continue  # its abort() comes before the next step
            except (TypeError, ValueError) as exc:  # a malformed stream: it alone
                outputs.append(StepOutput(request, error=exc))
                self._drop(key)
                continue
            if silent:  # the talker said nothing (its thinker ended before a first id)
                result = {"sample_rate": None, "audio_seconds": 0.0, "format": None,
                          "frames": 0, "finish_reason": "silent"}  # fmt: skip
                outputs.append(StepOutput(request, finished=True, result=result))
                self._drop(key)
        self._decode_due()
        for key, stream in list(self._streams.items()):
            ends = stream.final and stream.done == len(stream.frames)
            if not (stream.ready or ends):
                continue
            outputs.append(self._output(stream, ends))
            if ends:
                self._drop(key)
        return outputs

    def _take(self, key: int, request: Request) -> bool:
        """Read the request's new chunks; True: its stream ended without a chunk (silence)."""
        chunks, ended = request.take_stream()
        stream = self._streams.get(key)
        for chunk in chunks:
            if stream is None:
                stream = self._streams[key] = self._open(request, SpeechOptions.of(chunk))
            for frame in chunk.get("frames", ()):
                if len(frame) != self.groups:
                    raise ValueError(f"a frame of {len(frame)} codes; code2wav takes {self.groups}")
                stream.frames.append(list(frame))
            if "finish_reason" in chunk:
                stream.final, stream.finish_reason = True, chunk["finish_reason"]
        if ended:
            if stream is None:
                return True
            stream.final = True
        return False

    def _open(self, request: Request, speech: SpeechOptions) -> Stream:
        fmt = speech.response_format
        rate = speech.sample_rate or default_sample_rate(fmt, SAMPLE_RATE)
        return Stream(
            request, AudioEncoder(fmt, rate, streaming=speech.stream),
            StreamResampler(SAMPLE_RATE, rate),
        )  # fmt: skip

    def chunk_size(self, index: int) -> int:
        """Frames of chunk `index`: first_chunk_frames, doubling up to chunk_frames."""
        return min(self.chunk, self.first << min(index, 16))

    def _window(self, stream: Stream) -> Window | None:
        """The stream's next window to decode, or None: not due yet (or all decoded)."""
        have, done = len(stream.frames), stream.done
        count = self.chunk_size(stream.chunks)
        if have < done + count + self.lookahead:
            if not stream.final or have == done:
                return None  # not due yet (or all decoded)
            # the stream's rest, to its end (at most a chunk and the lookahead)
            return Window(stream, max(0, done - self.context), done, have - done, have, True)
        stop = done + count + self.lookahead
        return Window(stream, max(0, done - self.context), done, count, stop, False)

    def _decode_due(self) -> None:
        """Every due window, first chunks first; one call per window length."""
        due = [w for s in self._streams.values() if (w := self._window(s)) is not None]
        due.sort(key=lambda w: w.stream.chunks)  # stable: the oldest first among equals
        groups: dict[int, list[Window]] = {}
        for window in due:
            groups.setdefault(window.stop - window.start, []).append(window)
        for group in groups.values():
            self._decode(group)

    def _decode(self, group: list[Window]) -> None:
        codes = torch.tensor(
            [[list(col) for col in zip(*w.stream.frames[w.start : w.stop], strict=True)]
             for w in group],
            dtype=torch.long, device=self.device,
        )  # fmt: skip  # [B, G, L]
        with torch.inference_mode():
            audio = self.codec(codes)[:, 0].float().cpu().numpy()  # [B, L * spf - drop]
        self.decode_calls += 1
        for row, window in zip(audio, group, strict=True):
            begin = (window.keep - window.start) * self.spf
            end = len(row) if window.last else begin + window.count * self.spf
            window.stream.ready.append(row[begin:end])
            window.stream.done = window.keep + window.count
            window.stream.chunks += 1

    def _output(self, stream: Stream, ends: bool) -> StepOutput:
        samples = np.concatenate(stream.ready) if stream.ready else np.zeros(0, np.float32)
        stream.ready.clear()
        samples = stream.resampler.push(samples)
        if ends:
            samples = np.concatenate([samples, stream.resampler.flush()])
        data = stream.encoder.encode(samples)
        if ends:
            data += stream.encoder.finish()
        chunk = {"audio": data} if data else None
        if not ends:
            return StepOutput(stream.request, chunk=chunk)
        result = {
            "sample_rate": stream.encoder.sample_rate,
            "audio_seconds": stream.encoder.samples / stream.encoder.sample_rate,
            "format": stream.encoder.format,
            "frames": stream.done,
            "finish_reason": stream.finish_reason,
        }
        return StepOutput(stream.request, chunk=chunk, finished=True, result=result)

    def _drop(self, key: int) -> None:
        """The request ended here (finished or failed): the scheduler lets go of it too."""
        self._held.pop(key, None)
        stream = self._streams.pop(key, None)
        if stream is not None:
            stream.encoder.close()
