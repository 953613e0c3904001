"""Continuous batching: which requests run in the next forward, and how many tokens each.

Every step builds one batch whose cost (step_cost.py: a token weighs 1 + its context / K, so
attention over a long context counts) stays under `max_step_tokens`: first one decode token for
every running request whose prompt is done (oldest first), then prefill chunks. While requests
decode, the chunks together cost at most `max_prefill_beside_decodes`, so a long prompt is cut
into chunks that shrink as its context grows and the running streams keep their pace. Waiting
requests are admitted in arrival order; prompts then prefill shortest remainder first, so a
short chat arriving during a long prompt's prefill gets its first token in the next step, and
the long prompt takes what the budget leaves (the oldest prompt advances by one block at
least every step, so none starves).

KV admission: a waiting request is admitted only when blocks for all its current tokens are free
(its prefill then never needs more); it waits otherwise (head of line: later arrivals do not
overtake it). A decode that needs a new block when none is free preempts the newest running
request (frees its blocks, back to the head of the queue, recomputed on readmission); because one
request alone always fits (max_seq_len <= capacity), the oldest always progresses.

Playback-aware order: when a request's output is media (`playback_seconds`) and the step cannot
hold everyone, deadline_order.py fills it instead: urgent streams, then new requests' prefill
and first output, then the rest by their listeners' deadlines. When everyone fits, the batch
above runs. Either way, while media streams play, a step's prefill is held to what keeps every
started stream ahead of its listener (prefill_budget.py); text requests never are.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from omni_server.engine import deadline_order
from omni_server.engine.config import EngineConfig
from omni_server.engine.kv_cache import BlockAllocator
from omni_server.engine.prefill_budget import StepTimeFit, prefill_budget
from omni_server.engine.sequence import Sequence, Status
from omni_server.engine.step_batch import PrefillWork, StepBatch
from omni_server.engine.step_cost import StepCost
from omni_server.playback import StepClock

__all__ = ["Batcher", "PrefillWork", "StepBatch"]


class Batcher:
    def __init__(
        self,
        config: EngineConfig,
        allocator: BlockAllocator,
        cost: StepCost,
        prefill_beside_decodes: int,
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.cost = cost
        self.prefill_beside_decodes = prefill_beside_decodes
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # ordered by arrival
        self.num_preemptions = 0
        self.steps = StepClock()  # the engine records each step's time: the urgency margin
        self.step_time = StepTimeFit()  # seconds a step of given cost units takes
        # whether a running request's next decode row can run now (the head's optional
        # `ready`, head.py): one that cannot sits this step out, keeping its blocks
        self.ready: Callable[[Sequence], bool] = lambda seq: True

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def next_batch(self, now: float = 0.0, margin_s: float | None = None) -> StepBatch | None:
        """The next step's work. `now` (the engine's clock) dates listeners' deadlines; a lead
        under `margin_s` (default: the step clock's) is urgent."""
        margin = self.steps.margin_s if margin_s is None else margin_s
        if (
            self.config.playback_order
            and self.plays_media()
            and not self._everyone_fits(now, margin)
        ):
            return deadline_order.ordered_batch(self, now, margin)
        decodes = self._decodes()
        decode_units = sum(self.cost.decode(seq.num_computed) for seq in decodes)
        budget = self.config.max_step_tokens - decode_units
        if decodes:  # a running stream's step at most about doubles while prompts prefill
            budget = min(budget, max(self.prefill_beside_decodes, decode_units))
        prompts = [s for s in self.running if s.prefills_next]
        head = [self.waiting[0]] if self.waiting else []
        first = min([*prompts, *head], key=lambda s: s.arrival, default=None)
        # playing streams' listeners bound the step's time (prefill_budget.py); 0: none now
        deadline = self.deadline_budget(now, margin, decode_units, budget, first)
        budget = min(budget, deadline)
        prefilling = prompts + self._admit(budget)
        # Shortest remainder first (then arrival): a short prompt never waits behind a long one.
        prefilling.sort(key=lambda s: (s.num_tokens - s.num_computed, s.arrival))
        # The oldest prompt advances every step (the listeners allowing: prefill_budget.py),
        # by one block at least, whatever the budget.
        oldest = min(prefilling, key=lambda s: s.arrival, default=None)
        prefills: list[PrefillWork] = []
        for seq in prefilling:
            start, remaining = seq.num_computed, seq.num_tokens - seq.num_computed
            n = self.cost.fit(start, remaining, budget)
            floor = min(remaining, self.allocator.block_size)
            if seq is oldest and deadline > 0:
                n = max(n, floor)
            if n < floor:
                continue  # no slivers: a prompt advances by a block at least, or waits
            prefills.append(PrefillWork(seq, start, n))
            budget -= self.cost.chunk(start, n)
        if not decodes and not prefills:
            return None
        return StepBatch(decodes, prefills)

    def deadline_budget(
        self,
        now: float,
        margin_s: float,
        decode_units: float,
        ceiling: float,
        first_prompt: Sequence | None,
    ) -> float:
        """The prefill units a step of `decode_units` may hold so that every started stream's
        listener stays fed (prefill_budget.py); `ceiling` when no stream plays (text)."""
        if first_prompt is None or not self.config.playback_order:
            return ceiling
        leads = [
            (s.playback.lead(now), s.playback_seconds)
            for s in self.running
            if s.playback is not None and s.playback.started and s.playback_seconds is not None
        ]
        start = first_prompt.num_computed
        block = min(first_prompt.num_tokens - start, self.allocator.block_size)
        return prefill_budget(
            leads=leads,
            margin_s=margin_s,
            decode_units=decode_units,
            floor_units=self.cost.chunk(start, block),
            ceiling_units=ceiling,
            time=self.step_time.model(),
        )

    def _admit(self, budget: float) -> list[Sequence]:
        """Waiting requests that join now, in arrival order: while KV blocks for all their
        tokens are free, the batch has room, and the prompts admitted so far leave budget (a
        running prompt's prefill does not hold new ones back: they prefill first)."""
        admitted: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size:
            seq = self.waiting[0]
            if not self.ready(seq):
                break  # a preempted request whose last input is not in yet: it waits
            need = self.allocator.new_blocks(seq.block_table, seq.num_tokens)
            if not self.allocator.can_allocate(need):
                break  # KV full: wait for a request to finish
            self.waiting.popleft()
            self.admit(seq)
            admitted.append(seq)
            budget -= self.cost.chunk(seq.num_computed, seq.num_tokens - seq.num_computed)
        return admitted

    def record_step(self, seconds: float, batch: StepBatch) -> None:
        """The engine's measure of a step it ran: the urgency margin and the model of a step's
        time from its cost units (what a longer prefill would add to a step: prefill_budget.py)."""
        self.steps.record(seconds)
        units = sum(self.cost.decode(s.num_computed - 1) for s in batch.decodes) + sum(
            self.cost.chunk(p.start, p.length) for p in batch.prefills
        )
        self.step_time.record(units, seconds)

    def admit(self, seq: Sequence) -> None:
        """A waiting request joins the running ones, with KV blocks for all its tokens."""
        self.allocator.allocate(seq.block_table, seq.num_tokens)
        seq.status = Status.RUNNING
        self._insert_running(seq)

    def plays_media(self) -> bool:
        """Some request's output is media: the playback-aware order may apply."""
        return any(s.playback is not None for s in (*self.running, *self.waiting))

    def _everyone_fits(self, now: float, margin_s: float) -> bool:
        """The plain batch would hold every request whole this step: every running request
        decodes or finishes its prompt, every waiting one is admitted and prefills all of it,
        within what the playing streams' listeners allow (prefill_budget.py)."""
        if len(self.running) + len(self.waiting) > self.config.max_batch_size:
            return False
        decoding = [s for s in self.running if s.decodes_next]
        prompts = [s for s in (*self.running, *self.waiting) if s.prefills_next]
        blocks = sum(
            self.allocator.new_blocks(s.block_table, s.num_tokens)
            for s in (*decoding, *self.waiting)
        )
        if not self.allocator.can_allocate(blocks):
            return False
        decode_cost = sum(self.cost.decode(s.num_computed) for s in decoding)
        budget = self.config.max_step_tokens - decode_cost
        if decoding:
            budget = min(budget, max(self.prefill_beside_decodes, decode_cost))
        first = min(prompts, key=lambda s: s.arrival, default=None)
        budget = min(budget, self.deadline_budget(now, margin_s, decode_cost, budget, first))
        prefill_cost = sum(
            self.cost.chunk(s.num_computed, s.num_tokens - s.num_computed) for s in prompts
        )
        return prefill_cost <= budget

    def _decodes(self) -> list[Sequence]:
        decodes: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or not seq.decodes_next:
                continue  # preempted in this loop, or still prefilling
            if not self.ready(seq):
                continue  # its next input is not in yet: it runs in a later step
            need = self.allocator.new_blocks(seq.block_table, seq.num_tokens)
            if not need:  # 15 steps in 16 (block size 16): nothing to allocate or preempt
                decodes.append(seq)
                continue
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
