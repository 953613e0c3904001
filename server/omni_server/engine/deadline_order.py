"""Playback-aware batches: who steps when the next forward cannot hold every request.

A request whose output is media (`GenerationRequest.playback_seconds`: the Higgs TTS engine's
frames, 1/25 s each) carries its listener's deadline (omni_server.playback): the listener starts
at its first frame, so after `n` frames its lead is `first_at + n * playback_seconds - now`.
When everyone fits the step (rows under `max_batch_size`, cost under the token budget and its
cap beside decodes, KV blocks for every admission) the batcher's plain batch runs and nothing
changes. When not, the step is filled in this order (lower first; ties: the oldest request):

  0. urgent: lead below the margin (twice the recent step time, at least 50 ms): its next frame
     must come now or its listener runs dry; a request with no playback of its own (a thinker)
     ranks here too, so it keeps the pace it has without this order;
  1. new requests: their prefill and first frame (time to first audio is all they wait on);
  2. every other media request, earliest deadline first.

What the order changes against the plain batch:
- prompts' prefill takes what the step's budget leaves, up to what the tightest started stream
  can absorb (prefill_budget.py: the step's estimated time stays under every lead less the
  margin; none when decodes alone would restore the leads), and beside urgent (rank 0) decodes
  at most `max_prefill_beside_decodes`. A new request's first frame then comes in one or two
  steps instead of one small chunk a step, and a burst is admitted as fast as the leads allow;
- a request with lead sits out the step when rows or budget run out before its turn; it keeps
  its KV blocks and comes back when its lead falls under the margin (nothing starves: urgent
  requests outrank everything, and every lead shrinks while it waits);
- a media request may be admitted (given KV) beyond `max_batch_size` running requests while at
  most `max_batch_size - 1` of those have less than SLACK_S of lead: the ones ahead yield rows
  to it, and once too few are ahead admission waits again (no new request is taken on that the
  step's rows could not serve);
- a decode that needs a KV block when none is free preempts the running request that comes
  last in this order (the most lead, else the newest) instead of the newest.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Protocol

from omni_server.engine.config import EngineConfig
from omni_server.engine.kv_cache import BlockAllocator
from omni_server.engine.prefill_budget import StepTimeFit
from omni_server.engine.sequence import Sequence, Status
from omni_server.engine.step_batch import PrefillWork, StepBatch
from omni_server.engine.step_cost import StepCost

# A running request this far ahead of its listener may give its row to a new one (admission
# past max_batch_size running requests); seconds, so a stream with less keeps its row.
SLACK_S = 1.0


class BatcherView(Protocol):
    """What the order reads and moves of the batcher (batcher.py) it fills a step for."""

    config: EngineConfig
    allocator: BlockAllocator
    cost: StepCost
    prefill_beside_decodes: int
    step_time: StepTimeFit  # the measured steps: what a step of given cost takes
    waiting: deque[Sequence]
    running: list[Sequence]

    def admit(self, seq: Sequence) -> None: ...

    def deadline_budget(
        self,
        now: float,
        margin_s: float,
        decode_units: float,
        ceiling: float,
        first_prompt: Sequence | None,
    ) -> float: ...

    def preempt(self, seq: Sequence) -> None: ...


def check_playback_seconds(seconds: object) -> None:
    """ValueError unless `seconds` (a request's playback_seconds) is None or positive."""
    if seconds is None:
        return
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not 0 < seconds < math.inf
    ):
        raise ValueError(f"playback_seconds must be a positive number or None, got {seconds!r}")


def rank(seq: Sequence, now: float, margin_s: float) -> tuple[int, float, int]:
    """The order key of one request (see the module docstring); lower steps first."""
    playback = seq.playback
    if playback is None:
        return (0, -math.inf, seq.arrival)
    if not playback.started:
        return (1, 0.0, seq.arrival)
    deadline = playback.deadline()
    return (0 if deadline - now < margin_s else 2, deadline, seq.arrival)


def ordered_batch(batcher: BatcherView, now: float, margin_s: float) -> StepBatch | None:
    """The next step's batch filled in playback order (the module docstring)."""
    config, allocator, cost = batcher.config, batcher.allocator, batcher.cost
    order = sorted([*batcher.running, *batcher.waiting], key=lambda s: rank(s, now, margin_s))
    rows, budget = config.max_batch_size, float(config.max_step_tokens)
    decodes: list[Sequence] = []
    prefills: list[PrefillWork] = []
    chosen: set[int] = set()  # id(seq) of those in this batch
    preempted: set[int] = set()  # preempted in this step: they wait for the next
    urgent_cost = prefill_cost = 0.0
    absorb = _absorbable(batcher, order, now, margin_s)
    blocked = False  # a waiting request found no KV: later arrivals do not overtake it
    for seq in order:
        if rows == 0:
            break
        if id(seq) in preempted:
            continue
        urgent = rank(seq, now, margin_s)[0] == 0
        if seq.status is Status.RUNNING and seq.decodes_next:
            step_cost = cost.decode(seq.num_computed)
            if not urgent and step_cost > budget:
                continue  # sits out: its lead covers this step
            if not _room_to_decode(batcher, seq, order, chosen, preempted):
                continue
            allocator.allocate(seq.block_table, seq.num_tokens)
            decodes.append(seq)
            if urgent:
                urgent_cost += step_cost
        else:
            start, remaining = seq.num_computed, seq.num_tokens - seq.num_computed
            # what the tightest listener's lead lets the step cost; beside urgent decodes at
            # most the plain batch's share too
            cap = absorb
            if urgent_cost:
                cap = min(cap, max(batcher.prefill_beside_decodes, urgent_cost))
            if absorb <= 0:
                continue  # the listeners need this step's time: prompts wait (bounded)
            room = min(budget, cap - prefill_cost)
            n, floor = cost.fit(start, remaining, room), min(remaining, allocator.block_size)
            if n < floor and not prefills:
                n = floor  # the first prompt in order advances by a block at least: no starving
            if n < floor:
                continue  # no slivers: a prompt advances by a block at least, or waits
            if seq.status is Status.WAITING:
                if blocked or not _may_admit(batcher, seq, now):
                    continue
                need = allocator.new_blocks(seq.block_table, seq.num_tokens)
                if not allocator.can_allocate(need):
                    blocked = True
                    continue
                batcher.waiting.remove(seq)
                batcher.admit(seq)
            prefills.append(PrefillWork(seq, start, n))
            step_cost = cost.chunk(start, n)
            prefill_cost += step_cost
        chosen.add(id(seq))
        rows -= 1
        budget -= step_cost
    if not decodes and not prefills:
        return None
    return StepBatch(decodes, prefills)


def _absorbable(batcher: BatcherView, order: list[Sequence], now: float, margin_s: float) -> float:
    """The prefill cost units the step may hold before the tightest started stream's listener
    runs out (prefill_budget.py), its decodes counted as the first max_batch_size requests in
    `order` that decode (at most what the step will hold); inf-like: no stream has started."""
    decoding = [s for s in order if s.status is Status.RUNNING and s.decodes_next]
    decode_units = sum(
        batcher.cost.decode(s.num_computed) for s in decoding[: batcher.config.max_batch_size]
    )
    first = next((s for s in order if s.prefills_next), None)
    ceiling = float(batcher.config.max_step_tokens) - decode_units
    return batcher.deadline_budget(now, margin_s, decode_units, ceiling, first)


def _room_to_decode(
    batcher: BatcherView,
    seq: Sequence,
    order: list[Sequence],
    chosen: set[int],
    preempted: set[int],
) -> bool:
    """KV for `seq`'s next token, preempting the running request that comes last in `order`
    and is not in the batch yet (possibly `seq` itself: then False)."""
    allocator = batcher.allocator
    need = allocator.new_blocks(seq.block_table, seq.num_tokens)
    while not allocator.can_allocate(need):
        victim = next(
            s
            for s in reversed(order)
            if s.status is Status.RUNNING and id(s) not in chosen and id(s) not in preempted
        )  # `seq` itself qualifies: the search always ends
        batcher.preempt(victim)
        preempted.add(id(victim))
        if victim is seq:
            return False
    return True


def _may_admit(batcher: BatcherView, seq: Sequence, now: float) -> bool:
    """Room among the running requests: under max_batch_size, or (a media request) fewer than
    max_batch_size of them without SLACK_S of lead to give."""
    running, limit = batcher.running, batcher.config.max_batch_size
    if len(running) < limit:
        return True
    if seq.playback is None:
        return False
    short = sum(
        1
        for s in running
        if s.playback is None or not s.playback.started or s.playback.lead(now) < SLACK_S
    )
    return short < limit
