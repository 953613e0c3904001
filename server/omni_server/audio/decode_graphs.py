"""A codec's decoder (codes [B, K, L] -> audio [B, 1, L * hop]) replayed from CUDA graphs, one per
(batch bucket, window length), so that a chunk's decode costs one launch instead of the few
hundred small kernels a convolutional decoder runs eagerly (a step of the vocoder decodes a few
short windows: launch-bound, not compute-bound).

Invariants:
- a graph's input and output are static buffers: `decode` copies the codes in, replays, and
  returns a host copy, so a later replay cannot overwrite what a caller holds;
- rows are independent in the decoder (convolutions over time, per batch row), so a call of B
  windows runs the graph of the smallest bucket >= B, its spare rows holding whatever codes an
  earlier call left there (never read back), and the B rows' audio is that of decoding them
  alone (up to the convolution algorithm's rounding);
- every graph shares one memory pool: they replay one at a time on the caller's thread, and each
  output is copied to the host before the next replay.

`warm` captures the lengths a stream's chunks are known to take (first, second, steady) at
start, so serving starts with them in place. A (bucket, length) not captured yet is captured on
first use (a warm-up decode and a capture: tens of ms on the full decoder, during which the
caller waits), unless `capture_on_use` is off: then it runs eagerly, as every call does above
`max_graphs` or above the largest bucket. The vocoder turns it off: the lengths it has not
warmed are the last windows of streams shorter than the steady window, each a one-off, and
capturing them while serving stalled every stream (a profile under load on the H200 found a
quarter of the vocoder's time in such captures: docs/models.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class GraphedDecoder:
    def __init__(
        self,
        decode: Callable[[torch.Tensor], torch.Tensor],  # [B, K, L] int64 -> [B, 1, S] audio
        num_codebooks: int,
        device: torch.device | str,
        buckets: tuple[int, ...] = BUCKETS,
        max_graphs: int = 96,
        capture_on_use: bool = True,
    ) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        self._decode = decode
        self.k = num_codebooks
        self.buckets = tuple(sorted(buckets))
        self.max_graphs = max_graphs
        self.capture_on_use = capture_on_use
        self._pool = torch.cuda.graph_pool_handle()
        # (bucket, length) -> (graph, static codes [bucket, K, L], static audio [bucket, S])
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]]
        self._graphs = {}
        self.replays = 0  # calls served from a graph, and eagerly (counted for the logs)
        self.eager_calls = 0

    def warm(self, lengths: Iterable[int]) -> None:
        """Capture every bucket of each window length now (no capture pause while serving)."""
        for length in lengths:
            for bucket in self.buckets:
                self._graph(bucket, length)

    def decode(self, codes: np.ndarray) -> np.ndarray:  # [B, K, L] int64 -> [B, L * hop] f32
        rows, k, length = codes.shape
        if k != self.k:
            raise ValueError(f"codes of {k} codebooks, the decoder has {self.k}")
        bucket = next((b for b in self.buckets if b >= rows), None)
        entry = None
        if bucket is not None and (
            (bucket, length) in self._graphs
            or (self.capture_on_use and len(self._graphs) < self.max_graphs)
        ):
            entry = self._graph(bucket, length)
        if entry is None:
            self.eager_calls += 1
            with torch.inference_mode():
                values = self._decode(torch.from_numpy(codes).to(self.device))
            return values[:, 0].float().cpu().numpy()
        graph, static_codes, static_audio = entry
        static_codes[:rows].copy_(torch.from_numpy(codes), non_blocking=False)
        graph.replay()
        self.replays += 1
        return static_audio[:rows].cpu().numpy()

    def _graph(
        self, bucket: int, length: int
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        key = (bucket, length)
        if key in self._graphs:
            return self._graphs[key]
        static_codes = torch.zeros((bucket, self.k, length), dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            # warm-up on a side stream (cuDNN picks its algorithms, the allocator its blocks)
            # before the capture, as torch.cuda.graphs asks
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._decode(static_codes)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                static_audio = self._decode(static_codes)[:, 0].float()
        self._graphs[key] = (graph, static_codes, static_audio)
        return self._graphs[key]

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)
