"""A head's draw (logits -> tokens or frames, sampling.py / a family's) replayed from CUDA graphs.

The draw is pure tensor work over the logits and a few small per-row tables (no host state, no
sync: sampling.py's counter-based uniforms), so it can be captured. Eagerly it is 60-110 small
kernels a step (filters, hash, RAS); a replay is one launch. One graph per (rows bucket,
variant, the tables' row shapes): the variant is the head's (which branches the function
takes, e.g. sampled or greedy only, with or without repetition-aware redraws), fixed at
capture. It runs after the decode step's own graph (cuda_graphs.py), reading a copy of its
logits: the decode graphs belong to the runner and know no head's sampling.

Replay: logits [n, V] copied into the static [b, V] (device to device), each table's n rows
into its static buffer (host to device; rows past n keep stale rows, whose outputs are never
read: every operation is row by row), one replay; the output is the static buffer's first n
rows, valid until the next replay (the engine reads it, or queues its copy, before that).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from omni_server.engine.cuda_graphs import batch_buckets, bucket_for


@dataclass
class CapturedDraw:
    """One draw captured for a rows bucket, with the static buffers it reads and writes."""

    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [b, V] static input
    inputs: list[torch.Tensor]  # [b, ...] static inputs (tables, device tensors)
    out: tuple[torch.Tensor, ...]  # [b, ...] static outputs (a draw returns one or a tuple)


class DrawGraphs:
    """A draw function's graphs on one device (module doc): call it as the function."""

    def __init__(self, draw: Callable[..., Any], max_rows: int, device: torch.device):
        # draw(variant, logits [b, V], *inputs [b, ...]) -> [b, ...] or a tuple of them
        self.draw = draw
        self.device = device
        self.buckets = batch_buckets(max_rows)
        self.graphs: dict[tuple[Any, ...], CapturedDraw] = {}
        # static inputs by row shapes, [max_rows, ...] each: every bucket's graph reads the
        # first b rows (replays are in stream order, so one set of buffers serves them all)
        self.statics: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        self.pool: Any = None
        self._stream: Any = None

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def __call__(
        self, variant: Hashable, logits: torch.Tensor, inputs: list[torch.Tensor]
    ) -> torch.Tensor:
        """draw(variant, logits, *inputs) for the n rows of `logits`, from a graph."""
        (out,) = self.outputs(variant, logits, inputs)
        return out

    @torch.inference_mode()
    def outputs(
        self, variant: Hashable, logits: torch.Tensor, inputs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """`__call__` for a draw of several outputs: each one's first n rows."""
        n = logits.shape[0]
        b = bucket_for(n, self.buckets)
        shapes = tuple((tuple(x.shape[1:]), x.dtype) for x in (logits, *inputs))
        key = (variant, b, shapes)
        g = self.graphs.get(key)
        if g is None:
            g = self._capture(variant, b, self._statics(shapes, logits, inputs))
            self.graphs[key] = g
        g.logits[:n].copy_(logits)
        for static, x in zip(g.inputs, inputs, strict=True):
            static[:n].copy_(x, non_blocking=True)
        g.graph.replay()
        return tuple(out[:n] for out in g.out)

    def _statics(
        self, shapes: tuple[Any, ...], logits: torch.Tensor, inputs: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The static [max_rows, ...] buffers of inputs shaped like `logits` and `inputs`."""
        if shapes not in self.statics:
            rows = self.max_rows
            self.statics[shapes] = [
                torch.zeros((rows, *x.shape[1:]), dtype=x.dtype, device=self.device)
                for x in (logits, *inputs)
            ]
        return self.statics[shapes]

    def _capture(self, variant: Hashable, b: int, statics: list[torch.Tensor]) -> CapturedDraw:
        dev = self.device
        static_logits, *static = (x[:b] for x in statics)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=dev)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up kernels and the allocator outside the capture
                self.draw(variant, static_logits, *static)
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            out = self.draw(variant, static_logits, *static)
        if self.pool is None:
            self.pool = graph.pool()
        return CapturedDraw(graph, static_logits, static, out if isinstance(out, tuple) else (out,))
