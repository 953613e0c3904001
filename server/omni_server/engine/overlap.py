"""Decode steps launched one ahead of their tokens: the host's work overlaps the GPU's.

A synchronous step launches its graph, waits for the tokens, then does the host's work
(bookkeeping, events, the next schedule) while the GPU idles. Here a decode step N goes *in
flight*: its tokens are drawn on the device (a greedy row's argmax, inside the graph; a sampled
row's seeded draw, sampling.py, keyed by the token's position and so the synchronous step's
draw), written into the feed and copied to pinned memory behind the step (an event marks it),
and the step returns. The next `step()` schedules and launches N+1 first, whose input ids are
read on the device from the feed (the decode graphs' `feed`, or the eager runner's; a row's
host id is PENDING), and only then waits for N's tokens and does N's bookkeeping while N+1 runs.

Invariants:
  - a request in flight has one PENDING token at the end of `token_ids` per launched, unread
    step (one or two): the batcher sees it as decoding, with KV blocks for its next position,
    and its counters (num_computed, the blocks) already count the launched steps;
  - N+1 is launched ahead only when its batch is exactly N's rows in N's order (the feed is
    row-aligned): nothing waiting, no request prefilling, none whose max_tokens ends at N, and
    KV blocks free for every row (no preemption); otherwise N is settled first and the step
    runs as before;
  - a request that stops at N (EOS, a stop string) wastes its row of N+1: that row's K/V goes
    to a block already freed, which is safe because every later use of the block comes after
    N+1 on the same stream; its token is dropped when N+1 is settled (the request is finished);
  - abort / finish settle first, so they act on read tokens.
Prefills, media requests (their step clock), models whose head's greedy draw is no argmax
(head.py `argmax_is_draw`: an audio frame, whose next input is a frame, not a token id) and
tensor parallelism keep the synchronous path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_server.engine.batcher import Batcher, StepBatch
from omni_server.engine.config import EngineConfig
from omni_server.engine.sequence import Sequence, Status

PENDING = -1  # a token launched on the device and not read yet (never a vocabulary id)


def enabled(config: EngineConfig, graphs: bool, argmax_is_draw: bool, tp_size: int) -> bool:
    """Whether steps may go in flight (EngineConfig.overlap_decode)."""
    if config.overlap_decode == "off" or not argmax_is_draw or tp_size != 1:
        return False
    return graphs or config.overlap_decode == "on"


@dataclass
class InFlight:
    """A launched decode step whose tokens are not read yet."""

    seqs: list[Sequence]  # its rows, in order
    tokens: torch.Tensor  # [R] int64 host (pinned on CUDA): filled when `ready` completes
    ready: torch.cuda.Event | None  # None on the CPU (the copy is done when it returns)

    def read(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.tokens.tolist()


class Readback:
    """Two host buffers, used in turn: the step in flight fills one while the host reads the
    other (a step's copy never overwrites tokens not read yet: at most two steps are launched
    and unread, and the older is read before a third is launched)."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.device = device
        self.buffers = [
            torch.empty(max_rows, dtype=torch.int64, pin_memory=pinned) for _ in range(2)
        ]
        self.turn = 0

    def launch(self, seqs: list[Sequence], tokens: torch.Tensor) -> InFlight:
        """Queue the copy of `tokens` [R] behind the step that computes them."""
        buffer = self.buffers[self.turn][: len(seqs)]
        self.turn ^= 1
        if self.device.type != "cuda":
            buffer.copy_(tokens)
            return InFlight(seqs, buffer, None)
        buffer.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return InFlight(seqs, buffer, ready)


def goes_in_flight(batch: StepBatch, greedy: torch.Tensor | None, media: bool) -> bool:
    """A step whose tokens may be read one step late: decodes only, their argmax (the feed) on
    the device. Sampled rows too: their draws are the device's as well (`feed`)."""
    return greedy is not None and not media and not batch.prefills


def feed(greedy: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """The step's tokens where its successor reads its PENDING ids: `greedy` [R] is a view of
    the feed (the decode graphs' or the eager runner's), holding the argmax; sampled rows' draws
    overwrite theirs (stream order: after the step, before its successor's launch)."""
    if draws is not greedy:
        with torch.inference_mode():  # the feed is the runner's (an inference tensor)
            greedy.copy_(draws)
    return greedy


def can_launch_ahead(batcher: Batcher, flight: InFlight) -> bool:
    """Whether the next batch is exactly `flight`'s rows again, schedulable without its tokens."""
    running = batcher.running
    if batcher.waiting or len(running) != len(flight.seqs):
        return False
    need = 0
    allocator = batcher.allocator
    for seq, row in zip(running, flight.seqs, strict=True):
        if seq is not row or seq.status is not Status.RUNNING:
            return False
        if seq.num_output_tokens >= seq.max_tokens:  # its last token is in flight
            return False
        need += allocator.new_blocks(seq.block_table, seq.num_tokens)
    return allocator.can_allocate(need)


def launched(batch: StepBatch) -> None:
    """Account a step launched in flight: each row computed one more position, its token
    PENDING."""
    for seq in batch.decodes:
        seq.num_computed += 1
        seq.token_ids.append(PENDING)


def take_pending(seq: Sequence) -> int:
    """Remove `seq`'s PENDING tokens (at the end of token_ids); how many there were."""
    count = 0
    while seq.token_ids and seq.token_ids[-1] == PENDING:
        seq.token_ids.pop()
        count += 1
    return count
