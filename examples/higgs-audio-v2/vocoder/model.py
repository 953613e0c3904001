"""Vocoder (terminal, `kind = "ar"` fed by the engine's frames): generated frames -> 24 kHz
audio with the audio tokenizer's decoder, a chunk at a time as frames arrive, then speed, rate
and format.

The delay pattern is undone as frames come (`Undelay`); a chunk of `first_chunk_frames`
columns, then chunks doubling up to `chunk_frames` (4, 8, 16 at the defaults: the second must
arrive before the first has played, so it is short too; `grow_chunks = false`: 4, 16), is
decoded once `lookahead_frames` more are there, with up to `context_frames` before it, and
only its own columns' samples are kept: the decoder is a stack of convolutions, so with its
receptive field inside the window a chunk's samples equal those of decoding every code at once
(tests: >= 30 dB against the reference's one decode).

Batched across requests, as the engine is: each `step()` takes every stream's new frames
(`request.take_stream()`: the engine's step sends all its streams' frames in one message), then
decodes every due window, those of one length in one decoder call, and sends audio only for
the streams that have some. So a step costs one scheduler round and one message per stream
with audio, not one of each per frame and stream (a stream stage's generator would run once
for every frame). A stream's last window takes more left context, up to the steady window's
length, so that windows come in few lengths (first, second, steady): on a GPU each (batch
bucket, length) is one CUDA graph (`cuda_graphs = true`, the default there;
audio/decode_graphs.py), captured at start.

Speed: FFmpeg's `atempo` (PyAV), which keeps the pitch. Formats: the server's encoder. Result:
{"sample_rate", "audio_seconds", "format", "frames", "finish_reason"}, and "generated" (the
frames as the engine emitted them) when the stage parameter `return_frames` is true.

`stream_samples = true` (the example sets it: its `word_timing` stage comes after this one):
each chunk also carries the float32 samples of its audio as the listener hears them
("samples", at "sample_rate", after speed and resampling), the first the text spoken ("text"),
and the last this stage's result ("result"), which the stage after it returns as its own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import av
import av.filter
import numpy as np
import torch

from omni_server.audio.decode_graphs import BUCKETS, GraphedDecoder
from omni_server.audio.encode import AudioEncoder, default_sample_rate
from omni_server.audio.higgs_codec import (
    SAMPLE_RATE,
    HiggsCheckpointError,
    Undelay,
    Window,
    load_audio_tokenizer,
    next_window,
    open_checkpoint,
)
from omni_server.audio.resample import StreamResampler
from omni_server.backend import (
    Request,
    RequestAborted,
    StageBackend,
    StageConfigError,
    StageContext,
    StepOutput,
)

log = logging.getLogger("omni_server.examples.higgs.vocoder")

# parameters in columns (frames of 8 codes, 40 ms of audio each): name, default, least
SIZES = (
    ("first_chunk_frames", 4, 1),
    ("chunk_frames", 16, 1),
    ("context_frames", 12, 0),
    ("lookahead_frames", 10, 0),
    ("first_lookahead_frames", None, 0),  # the first chunk's (None: lookahead_frames)
)


@dataclass(eq=False)
class Stream:
    """One request's audio in the making (opened at its first frames, which say the format)."""

    request: Request
    undelay: Undelay
    encoder: AudioEncoder
    resampler: StreamResampler
    tempo: Tempo | None
    final: bool = False  # the engine's last frame came
    done: int = 0  # columns decoded
    chunks: int = 0  # chunks decoded (their sizes grow: Vocoder.chunk_size)
    ready: list[np.ndarray] = field(default_factory=list)  # decoded, not yet sent
    generated: list[list[int]] = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None  # the text spoken (stream_samples: sent with the first chunk)
    sent: int = 0  # chunks sent


class Vocoder(StageBackend):
    def initialize(self, context: StageContext) -> None:
        params = context.parameters
        if context.device == "cpu":
            torch.set_num_threads(int(params.get("intra_op_threads", 1)))
        try:
            checkpoint = open_checkpoint(context.repository_parameters)
            self.codec = load_audio_tokenizer(checkpoint, context.device)
        except HiggsCheckpointError as err:
            raise StageConfigError(str(err)) from err
        self.device = context.device
        self.k = int(self.codec.config.num_quantizers)
        self.bos = int(self.codec.config.codebook_size)
        self.hop = int(self.codec.config.hop_length)
        sizes = {}
        for key, default, least in SIZES:
            value = params.get(key, default)
            if value is None:  # first_lookahead_frames unset: lookahead_frames
                value = params.get("lookahead_frames", 10)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise StageConfigError(
                    f"parameters.{key} must be an integer >= {least}; got {value!r}"
                )
            sizes[key] = value
        self.first, self.chunk = sizes["first_chunk_frames"], sizes["chunk_frames"]
        self.context, self.lookahead = sizes["context_frames"], sizes["lookahead_frames"]
        self.first_lookahead = sizes["first_lookahead_frames"]
        self.return_frames = bool(params.get("return_frames", False))
        samples = params.get("stream_samples", False)
        if not isinstance(samples, bool):
            raise StageConfigError(
                f"parameters.stream_samples must be true or false; got {samples!r}"
            )
        self.stream_samples = samples
        grow = params.get("grow_chunks", True)
        if not isinstance(grow, bool):
            raise StageConfigError(f"parameters.grow_chunks must be true or false; got {grow!r}")
        self.grow = grow
        # a step decodes for about step_budget_ms (one call at least), the most urgent windows
        # first; the rest waits for the next step (has_work), so a long backlog never holds
        # back first chunks and new frames. decode_batch: the most windows in one call (a GPU
        # gains from several, but a call of many holds the GPU from the engine beside it; a CPU
        # decodes one window faster alone: docs/models.md)
        self.step_budget_s = self._positive(params, "step_budget_ms", 10.0) / 1000
        gpu = torch.device(self.device).type == "cuda"
        batch = params.get("decode_batch", 16 if gpu else 1)
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise StageConfigError(
                f"parameters.decode_batch must be an integer >= 1; got {batch!r}"
            )
        self.decode_batch = batch
        graphs = params.get("cuda_graphs", True)
        if not isinstance(graphs, bool):
            raise StageConfigError(f"parameters.cuda_graphs must be true or false; got {graphs!r}")
        self.graphs: GraphedDecoder | None = None
        if graphs and gpu:
            # buckets up to decode_batch only: a call never holds more windows. Lengths not
            # warmed here (a short stream's last window) decode eagerly: a capture while
            # serving would stall every stream for a one-off window
            buckets = (*(b for b in BUCKETS if b < batch), batch)
            self.graphs = GraphedDecoder(
                self._decode_codes, self.k, self.device, buckets, capture_on_use=False
            )
            self.graphs.warm(self.window_lengths())
            log.info("vocoder: %d decoder graphs captured (window lengths %s)",
                     self.graphs.num_graphs, self.window_lengths())  # fmt: skip
        self._backlog = False
        self._held: dict[int, Request] = {}  # id(request) -> request, from add() to its end
        self._streams: dict[int, Stream] = {}  # id(request) -> its stream, once frames came
        self.decode_calls = 0  # decoder calls, and the windows they held (batching, logged)
        self.decoded_windows = 0
        self.decode_seconds = 0.0  # in _decode: codes gathered, decoded, audio on the host

    @staticmethod
    def _positive(params: Any, key: str, default: float) -> float:
        value = params.get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise StageConfigError(f"parameters.{key} must be a number > 0; got {value!r}")
        return float(value)

    # ---- the ar contract (one compute thread: no locks) ---------------------------------------

    def add(self, request: Request) -> None:
        self._held[id(request)] = request

    def abort(self, request: Request) -> None:
        self._held.pop(id(request), None)
        stream = self._streams.pop(id(request), None)
        if stream is not None:
            stream.encoder.close()
            log.info("vocoder: stopped %s after %d columns (%d streams running)",
                     request.id, stream.done, len(self._streams))  # fmt: skip

    def step(self) -> list[StepOutput]:
        """Take every stream's new frames, decode the due windows, send what was decoded."""
        outputs: list[StepOutput] = []
        for key, request in list(self._held.items()):
            try:
                self._take(key, request)
            except RequestAborted:
                continue  # its abort() comes before the next step
            except Exception as exc:  # noqa: BLE001 - a malformed stream fails its request alone
                outputs.append(StepOutput(request, error=exc))
                self._drop(key)
        self._backlog = self._decode_due(time.perf_counter() + self.step_budget_s)
        for key, stream in list(self._streams.items()):
            ends = stream.final and self._window(stream) is None  # every column decoded
            if not (stream.ready or ends):
                continue
            try:
                outputs.append(self._output(stream, ends))
            except Exception as exc:  # noqa: BLE001 - its encoder failed: that request alone
                outputs.append(StepOutput(stream.request, error=exc))
                self._drop(key)
                continue
            if ends:
                self._drop(key)
        return outputs

    def _take(self, key: int, request: Request) -> None:
        chunks, ended = request.take_stream()
        stream = self._streams.get(key)
        for chunk in chunks:
            if stream is None:
                stream = self._streams[key] = self._open(request, chunk["encoding"])
                stream.text = chunk.get("text")
            for frame in chunk["frames"]:
                stream.undelay.push(frame)
            if self.return_frames:
                stream.generated.extend(chunk["frames"])
            if "finish_reason" in chunk:
                stream.final, stream.finish_reason = True, chunk["finish_reason"]
        if ended:
            if stream is None:
                raise RuntimeError("the engine sent no frame")
            stream.final = True

    def _output(self, stream: Stream, ends: bool) -> StepOutput:
        """The stream's decoded audio as its next chunk; at its end, its tail and result too."""
        audio, samples = self._send(stream, last=ends)
        chunk: dict[str, Any] | None = {"audio": audio} if audio else None
        if self.stream_samples:  # every step's audio, and the end, reach the stage after
            chunk = {"audio": audio, "samples": samples, "sample_rate": stream.encoder.sample_rate}
            if stream.sent == 0:
                chunk["text"] = stream.text  # None: no timing asked for
        stream.sent += 1
        if not ends:
            return StepOutput(stream.request, chunk=chunk)
        result: dict[str, Any] = {
            "sample_rate": stream.encoder.sample_rate,
            "audio_seconds": stream.encoder.samples / stream.encoder.sample_rate,
            "format": stream.encoder.format,
            "frames": stream.done,
            "finish_reason": stream.finish_reason,
        }
        if self.return_frames:
            result["generated"] = stream.generated
        if chunk is not None and self.stream_samples:
            chunk["result"] = result
        return StepOutput(stream.request, chunk=chunk, finished=True, result=result)

    def _drop(self, key: int) -> None:
        """The request ended here (finished or failed): the scheduler lets go of it too."""
        self._held.pop(key, None)
        stream = self._streams.pop(key, None)
        if stream is not None:
            stream.encoder.close()

    def _open(self, request: Request, encoding: dict[str, Any]) -> Stream:
        fmt = encoding["format"]
        rate = encoding["sample_rate"] or default_sample_rate(fmt, SAMPLE_RATE)
        speed = float(encoding.get("speed", 1.0))
        return Stream(
            request,
            Undelay(self.k, self.bos, self.bos + 1),
            AudioEncoder(fmt, rate, streaming=encoding["stream"]),
            StreamResampler(SAMPLE_RATE, rate),
            None if speed == 1.0 else Tempo(SAMPLE_RATE, speed),
        )

    def _decode_due(self, deadline: float) -> bool:
        """Decode due windows, the most urgent first (fewest chunks sent, then the oldest
        stream: a first chunk before anyone's later ones), with every due window of that one's
        length in the same call (up to decode_batch), until `deadline` (one call at least).
        True: due windows are left for the next step."""
        calls = 0
        while True:
            due = [(s, w) for s in self._streams.values() if (w := self._window(s)) is not None]
            if not due:
                return False
            if calls and time.perf_counter() >= deadline:
                return True
            due.sort(key=lambda item: item[0].chunks)  # stable: the oldest first among equals
            length = due[0][1].stop - due[0][1].start
            group = [item for item in due if item[1].stop - item[1].start == length]
            self._decode(group[: self.decode_batch])
            calls += 1

    def _window(self, stream: Stream) -> Window | None:
        """The stream's next window to decode, or None: not due yet (or all decoded)."""
        return next_window(
            stream.done,
            stream.undelay.columns(),
            stream.final or stream.undelay.ended,
            chunk=self.chunk_size(stream.chunks),
            context=self.context,
            lookahead=self.lookahead_of(stream.chunks),
            span=self.context + self.chunk + self.lookahead,
        )

    def has_work(self) -> bool:
        """The last step left due windows undecoded (its time ran out): step again."""
        return self._backlog

    def window_lengths(self) -> list[int]:
        """The lengths a stream's windows take before the last: the first chunks' (they start
        at column 0, so lack some context) up to the steady one, which the last window takes
        too wherever the stream has that many columns."""
        lengths, done, index = [], 0, 0
        while True:
            chunk = self.chunk_size(index)
            start = max(0, done - self.context)
            length = done + chunk + self.lookahead_of(index) - start
            if length in lengths and start > 0:
                return lengths
            if length not in lengths:
                lengths.append(length)
            done, index = done + chunk, index + 1

    def lookahead_of(self, index: int) -> int:
        """Columns decoded after chunk `index` (its right context): a smaller first one trades
        the first chunk's fidelity for first audio sooner (docs/models.md)."""
        return self.first_lookahead if index == 0 else self.lookahead

    def chunk_size(self, index: int) -> int:
        """Columns of a stream's chunk `index`: first_chunk_frames, then doubling up to
        chunk_frames (grow_chunks = false: chunk_frames at once)."""
        if index == 0:
            return self.first
        if not self.grow:
            return self.chunk
        return min(self.chunk, self.first << min(index, 16))

    def _decode(self, group: list[tuple[Stream, Window]]) -> None:
        begin_s = time.perf_counter()
        codes = np.stack([s.undelay.codes(w.start, w.stop) for s, w in group])  # [B, K, L]
        if self.graphs is not None:
            audio = self.graphs.decode(codes)  # [B, L * hop]
        else:
            with torch.inference_mode():
                values = self._decode_codes(torch.from_numpy(codes).to(self.device))
            audio = values[:, 0].float().cpu().numpy()
        self.decode_calls += 1
        self.decoded_windows += len(group)
        self.decode_seconds += time.perf_counter() - begin_s
        if self.decode_calls % 500 == 0:  # how the decoder is used, for the benchmarks' logs
            graphs = self.graphs
            how = (
                "eager"
                if graphs is None
                else f"{graphs.num_graphs} graphs, {graphs.eager_calls} eager"
            )
            log.info("vocoder: %d decoder calls, %.2f windows a call, %.2f ms a call, %s",
                     self.decode_calls, self.decoded_windows / self.decode_calls,
                     1000 * self.decode_seconds / self.decode_calls, how)  # fmt: skip
        for row, (stream, window) in zip(audio, group, strict=True):
            begin = (window.keep - window.start) * self.hop
            stream.ready.append(row[begin : begin + window.count * self.hop])
            stream.done = window.keep + window.count
            stream.chunks += 1

    def _decode_codes(self, codes: torch.Tensor) -> torch.Tensor:  # [B, K, L] -> [B, 1, S]
        return self.codec.decode(codes)

    def _send(self, stream: Stream, last: bool = False) -> tuple[bytes, np.ndarray]:
        """The stream's decoded audio, at its speed and rate, as the next body bytes (and
        the samples they encode)."""
        samples = np.concatenate(stream.ready) if stream.ready else np.zeros(0, np.float32)
        stream.ready.clear()
        if stream.tempo is not None:
            samples = stream.tempo.push(samples, last)
        samples = stream.resampler.push(samples)
        if last:
            samples = np.concatenate([samples, stream.resampler.flush()])
        data = stream.encoder.encode(samples)
        return (data + stream.encoder.finish() if last else data), samples


class Tempo:
    """Speed without a pitch change: FFmpeg's atempo filter (0.5..2 a stage, chained)."""

    def __init__(self, rate: int, speed: float) -> None:
        self.rate = rate
        self.graph = av.filter.Graph()
        node = self.graph.add_abuffer(format="flt", sample_rate=rate, layout="mono")
        factors, rest = [], speed
        while rest > 2.0:
            factors.append(2.0)
            rest /= 2.0
        while rest < 0.5:
            factors.append(0.5)
            rest /= 0.5
        for factor in [*factors, rest]:
            stage = self.graph.add("atempo", f"{factor:.6f}")
            node.link_to(stage)
            node = stage
        sink = self.graph.add("abuffersink")
        node.link_to(sink)
        self.graph.configure()

    def push(self, samples: np.ndarray, last: bool) -> np.ndarray:
        if len(samples):
            frame = av.AudioFrame.from_ndarray(
                samples.astype(np.float32).reshape(1, -1), format="flt", layout="mono"
            )
            frame.sample_rate = self.rate
            self.graph.push(frame)
        if last:
            self.graph.push(None)
        out = []
        while True:
            try:
                out.append(self.graph.pull().to_ndarray().reshape(-1))
            except (av.BlockingIOError, av.EOFError):
                break
        return np.concatenate(out) if out else np.zeros(0, np.float32)
