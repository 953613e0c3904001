"""Continuous batching: which requests run in the next forward, and how many tokens each.

Every step builds one batch under `max_step_tokens`: first one decode token for every running
request whose prompt is done (oldest first), then prefill chunks: running requests still
prefilling, then waiting requests admitted in arrival order. A long prompt is thus cut into chunks
and decodes never wait behind it.

KV admission: a waiting request is admitted only when blocks for all its current tokens are free
(its prefill then never needs more); it waits otherwise (head of line: later arrivals do not
overtake it). A decode that needs a new block when none is free preempts the newest running
request (frees its blocks, back to the head of the queue, recomputed on readmission); because one
request alone always fits (max_seq_len <= capacity), the oldest always progresses.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from omni_server.engine.config import EngineConfig
from omni_server.engine.kv_cache import BlockAllocator
from omni_server.engine.sequence import Sequence, Status


@dataclass
class PrefillWork:
    seq: Sequence
    start: int  # first position computed this step (== seq.num_computed)
    length: int

    @property
    def completes_prompt(self) -> bool:
        """After this chunk every token is computed: sample the next one."""
        return self.start + self.length == self.seq.num_tokens


@dataclass
class StepBatch:
    decodes: list[Sequence]  # one token each, at position seq.num_computed
    prefills: list[PrefillWork]

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(p.length for p in self.prefills)


class Batcher:
    def __init__(self, config: EngineConfig, allocator: BlockAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # ordered by arrival
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def next_batch(self) -> StepBatch | None:
        decodes = self._decodes()
        budget = self.config.max_step_tokens - len(decodes)
        prefills: list[PrefillWork] = []
        for seq in self.running:
            remaining = seq.num_tokens - seq.num_computed
            if remaining > 1 and budget > 0:
                n = min(remaining, budget)
                prefills.append(PrefillWork(seq, seq.num_computed, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size:
            seq = self.waiting[0]
            need = self.allocator.new_blocks(seq.block_table, seq.num_tokens)
            if not self.allocator.can_allocate(need):
                break  # KV full: wait for a request to finish
            self.waiting.popleft()
            self.allocator.allocate(seq.block_table, seq.num_tokens)
            seq.status = Status.RUNNING
            self._insert_running(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            prefills.append(PrefillWork(seq, seq.num_computed, n))
            budget -= n
        if not decodes and not prefills:
            return None
        return StepBatch(decodes, prefills)

    def _decodes(self) -> list[Sequence]:
        decodes: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.num_tokens - seq.num_computed != 1:
                continue  # preempted in this loop, or still prefilling
            need = self.allocator.new_blocks(seq.block_table, seq.num_tokens)
            while not self.allocator.can_allocate(need):
                victim = self.running[-1]  # newest; never one already in `decodes` (older)
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.allocator.allocate(seq.block_table, seq.num_tokens)
                decodes.append(seq)
        return decodes

    def _insert_running(self, seq: Sequence) -> None:
        i = len(self.running)
        while i > 0 and self.running[i - 1].arrival > seq.arrival:
            i -= 1
        self.running.insert(i, seq)

    def preempt(self, seq: Sequence) -> None:
        """Give `seq`'s blocks back; it recomputes its tokens (prompt + output) when readmitted."""
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted request and free its blocks at once."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.allocator.free(seq.block_table)
        seq.status = Status.FINISHED
