"""Decode steps captured in CUDA graphs, one per (padded batch size, padded context) bucket.

A decode step of a small model is launch-bound on a GPU (~25 kernels a layer): replaying a
captured graph removes the per-kernel CPU cost. Shapes in a graph are fixed, so a step of B
requests with longest context L runs the graph of the smallest bucket (b >= B, l >= L):

  padded rows:     token 0 at position 0, K/V written to the scratch block 0; paged: context 0
                   (the kernel writes zeros), gathered: attending to slot 0
  padded context:  paged: nothing (the kernel reads each request's blocks up to its context;
                   the bucket bounds the block table's width and so the kernel's grid);
                   gathered: slots beyond a request's context point at slot 0, masked out

A step that also holds prefill chunks replays its decode rows' graph the same way and runs the
chunks eagerly after it (runner.py, the split launch).

Batch buckets 1, 2, 4, 8, then steps of 8 up to max_batch_size; context buckets powers of two
from 256 up to max_seq_len. Graphs are captured lazily on first use (or all at once by
`capture_all`) and share one memory pool; their inputs are static buffers the step copies into.

A step's inputs travel in one host-to-device copy: each graph's token rows (ids, positions,
slots: int64) and, paged, its context lengths and block table (int32, viewed in the same bytes)
are views of one device buffer, filled from one pinned host buffer of the same layout. A text
model whose head draws the argmax (a text token; head.py `argmax_is_draw`) has its graph take
the greedy token of every row too: a greedy step then reads [b] int64 back instead of launching
an argmax over [b, V] logits. Inputs a model reads besides token ids are the head's: static
buffers made once per graph (`graph_inputs`), filled before each replay.

The greedy tokens go to one device buffer all graphs share, `feed` [max_batch_size] int64, and
each graph reads its input ids through it: a row whose host id is negative (overlap.PENDING)
embeds feed[row], the token the step before it (any bucket) computed for that row. So a greedy
step can be launched before the previous step's tokens reach the host (overlap.py). Graphs
replay in stream order, so a graph's feed is the last replayed graph's argmax.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from omni_server.engine import fused
from omni_server.engine.attention import DecodeGroup, ForwardBatch
from omni_server.engine.head import StepModel
from omni_server.engine.kv_cache import KVCache
from omni_server.engine.sequence import Sequence


def batch_buckets(max_batch_size: int) -> list[int]:
    sizes = [b for b in (1, 2, 4) if b < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    return [*sizes, max_batch_size]


def context_buckets(max_seq_len: int, smallest: int = 256) -> list[int]:
    sizes = []
    size = smallest
    while size < max_seq_len:
        sizes.append(size)
        size *= 2
    return [*sizes, max_seq_len]


def bucket_for(value: int, buckets: list[int]) -> int:
    for b in buckets:
        if b >= value:
            return b
    raise ValueError(f"{value} exceeds the largest bucket {buckets[-1]}")


@dataclass
class CapturedGraph:
    """One decode step captured for a (batch, context) bucket, with the buffers it reads and
    writes: replaying it runs the step on whatever those buffers hold."""

    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch  # static input buffers the graph reads (views of `inputs`)
    logits: torch.Tensor  # [b, V] static output
    greedy: torch.Tensor | None  # [b] int64 argmax of each row's logits (argmax_is_draw)
    inputs: torch.Tensor  # int64 device buffer: [3, b] token rows, then the int32 section
    host: torch.Tensor  # the pinned host buffer `inputs` is copied from, the same layout
    copied: torch.cuda.Event  # recorded after each copy out of `host`: refill only after it

    # numpy views of `host` (wait for `copied` before writing them): token rows [3, b] int64,
    # context lengths [b] int32 and block table [b, W] int32 (both empty for a gathered graph)
    host_rows: Any
    host_lens: Any
    host_table: Any


@dataclass
class DecodeOutput:
    logits: torch.Tensor  # [B, ...] float32, the head's logits
    greedy: torch.Tensor | None  # [B] int64 argmax of each row, from the graph (argmax_is_draw)


class DecodeGraphs:
    def __init__(
        self,
        model: StepModel,
        cache: KVCache,
        max_batch_size: int,
        max_seq_len: int,
        paged: bool = False,  # decode attention by the paged kernel (block tables, no gather)
        forward: Callable[..., torch.Tensor] | None = None,  # e.g. the torch.compile'd forward
    ) -> None:
        self.model = model
        self.head = model.head
        self.paged = paged
        self.forward = forward or model.forward
        self.cache = cache
        self.device = next(model.parameters()).device
        self.batch_buckets = batch_buckets(max_batch_size)
        self.context_buckets = context_buckets(max_seq_len)
        self.graphs: dict[tuple[int, int], CapturedGraph] = {}
        self.pool: Any = None  # one memory pool shared by all graphs
        # [max_batch_size] int64: the last replayed graph's argmax by row (module doc)
        self.feed = torch.zeros(max_batch_size, dtype=torch.int64, device=self.device)
        self._stream: Any = None  # the side stream graphs warm up and are captured on

    def capture_all(self) -> None:
        for b in self.batch_buckets:
            for length in self.context_buckets:
                self.graph_for(b, length)

    def run(
        self,
        ids: list[int],
        positions: list[int],
        slot_mapping: list[int],
        tables: list[list[int]],  # [B] each request's block table
        context: list[int],  # [B] context length of each request (L = max)
        decodes: list[Sequence] | None = None,  # [B] the requests: the head's inputs (if any)
    ) -> DecodeOutput:
        n, length = len(ids), max(context)
        b, bucket = bucket_for(n, self.batch_buckets), bucket_for(length, self.context_buckets)
        g = self.graph_for(b, bucket)
        s = g.batch
        assert s.decode is not None
        g.copied.synchronize()  # the previous step's copy out of `host` is done
        rows, lens, table = g.host_rows, g.host_lens, g.host_table
        # Padded rows: token 0 at position 0 into slot 0 (the scratch block), context 0.
        rows[:, n:] = 0
        rows[0, :n], rows[1, :n], rows[2, :n] = ids, positions, slot_mapping
        if self.paged:
            lens[:n] = context
            lens[n:] = 0  # padded rows: the kernel writes zeros
            width = -(-length // self.cache.block_size)
            # Entries past a request's context are never read: only the live part is written.
            for row, blocks in enumerate(tables):
                live = blocks[:width]
                table[row, : len(live)] = live
        g.inputs.copy_(g.host, non_blocking=True)
        g.copied.record()
        if not self.paged:
            assert s.decode.kv_slots is not None and s.decode.kv_mask is not None
            kv_slots = self.cache.slot_matrix(tables, length)
            s.decode.kv_slots.zero_()
            s.decode.kv_mask.zero_()
            s.decode.kv_mask[:, 0, 0, 0] = True  # padded rows attend to the scratch slot
            s.decode.kv_slots[:n, :length].copy_(kv_slots, non_blocking=True)
            mask = torch.arange(length).unsqueeze(0) < torch.tensor(context).unsqueeze(1)
            s.decode.kv_mask[:n, 0, 0, :length].copy_(mask, non_blocking=True)
        if s.family_inputs is not None:  # the head's, besides token ids (padded rows: unused)
            assert decodes is not None, "a model with inputs of its own is given the requests"
            self.head.fill_graph_inputs(s.family_inputs, decodes)
        g.graph.replay()
        return DecodeOutput(g.logits[:n], None if g.greedy is None else g.greedy[:n])

    def graph_for(self, b: int, length: int) -> CapturedGraph:
        """The graph of batch bucket `b` and context bucket `length`, captured on first use
        (`run` replays it; `omni-bench chat` times a bare replay of it as the floor)."""
        key = (b, length)
        if key in self.graphs:
            return self.graphs[key]
        dev = self.device
        # One buffer a step's copy fills: [3, b] int64 rows, then b + b * W int32 (paged)
        width = -(-length // self.cache.block_size) if self.paged else 0
        small = b + b * width if self.paged else 0
        size = 3 * b + -(-small // 2)
        inputs = torch.zeros(size, dtype=torch.int64, device=dev)
        host = torch.zeros(size, dtype=torch.int64, pin_memory=True)
        rows = inputs[: 3 * b].view(3, b)
        if self.paged:
            int32 = inputs[3 * b :].view(torch.int32)
            lens = int32[:b]
            lens.fill_(1)  # capture and warm-up: one key, slot 0
            decode = DecodeGroup(
                b,
                block_tables=int32[b : b + b * width].view(b, width),
                context_lens=lens,
                block_size=self.cache.block_size,
            )
        else:
            mask = torch.zeros(b, 1, 1, length, dtype=torch.bool, device=dev)
            mask[:, 0, 0, 0] = True
            slots = torch.zeros(b, length, dtype=torch.int64, device=dev)
            decode = DecodeGroup(b, slots, mask)
        static = ForwardBatch(
            input_ids=rows[0],
            positions=rows[1],
            slot_mapping=rows[2],
            logits_indices=torch.arange(b, device=dev),
            decode=decode,
            prefills=[],
            family_inputs=self.head.graph_inputs(b, dev),
        )
        argmax = self.head.argmax_is_draw
        # One side stream for every warm-up and capture: each stream a matmul runs on keeps a
        # cuBLAS workspace for good, so a fresh stream per graph would hold up to 32 of them.
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=dev)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm up kernels / allocator outside the capture
                logits = self.forward(static, self.cache.k, self.cache.v)
                if argmax:  # not into the feed: a step in flight may need it next
                    fused.greedy_tokens(logits, torch.empty(b, dtype=torch.int64, device=dev))
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream), torch.inference_mode():
            greedy = None
            if argmax:  # PENDING rows embed the previous step's token
                static.input_ids = torch.where(rows[0] < 0, self.feed[:b], rows[0])
            logits = self.forward(static, self.cache.k, self.cache.v)
            if argmax:  # the argmax (sampling.greedy_tokens), written into the feed
                greedy = fused.greedy_tokens(logits, out=self.feed[:b])
        if self.pool is None:
            self.pool = graph.pool()
        copied = torch.cuda.Event()
        copied.record()
        small_host = host[3 * b :].view(torch.int32).numpy()
        captured = CapturedGraph(
            graph, static, logits, greedy, inputs, host, copied,
            host_rows=host[: 3 * b].numpy().reshape(3, b),
            host_lens=small_host[:b],
            host_table=small_host[b : b + b * width].reshape(b, width),
        )  # fmt: skip
        self.graphs[key] = captured
        return captured
