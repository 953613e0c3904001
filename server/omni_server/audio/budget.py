"""A bound on the decoded audio a process holds at once, across all its requests.

An upload is small (a silent 29-minute FLAC is 320 KB) but its decoded samples are not (16 kHz
float32: 3.8 MB a minute), so a bound on upload bytes bounds nothing here. The decoder writes
into `BudgetedSamples`, which takes each growth of its array from a `SampleBudget` first
(refused past the total) and ties the return to the array itself: the budget comes back when
the last reference to the array goes, in whichever stage and thread drops it, so audio that
later stages of the same process still read stays counted.

Invariant: `held` is the sum of the takes not yet returned; it never exceeds `total` (a take
that would is refused whole, taking nothing).
"""

from __future__ import annotations

import threading
import weakref

import numpy as np


class BudgetExhausted(Exception):
    """The process holds too much decoded audio now; the message says how much."""


class SampleBudget:
    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"a sample budget needs a positive total, got {total}")
        self.total = total
        self._held = 0
        self._lock = threading.Lock()  # takes on the decoder's thread, returns on any

    @property
    def held(self) -> int:
        return self._held

    def take(self, samples: int) -> None:
        """Reserve `samples` more, or raise BudgetExhausted (reserving nothing)."""
        with self._lock:
            if self._held + samples > self.total:
                raise BudgetExhausted(
                    f"{self._held} of {self.total} samples are held by other requests"
                )
            self._held += samples

    def give_back(self, samples: int) -> None:
        with self._lock:
            assert samples <= self._held, "returned more than was taken"
            self._held -= samples


class BudgetedSamples:
    """Float32 samples written block by block into one array that grows as they arrive (no
    list of blocks to join), each growth taken from `budget` first, never past
    `capacity_limit` samples.

    Who may call: one thread (the decoder's) until `finish()`. The budget this holds is given
    back when it is dropped unfinished, or, after `finish()`, when the returned array's memory
    is freed (a finalizer on that memory)."""

    GROWTH = 1.5  # capacity grows geometrically: a few reallocations for a long clip

    def __init__(self, budget: SampleBudget, capacity_limit: int, expected: int) -> None:
        self._budget = budget
        self._limit = capacity_limit
        self._array = np.zeros(0, np.float32)
        self._charged = [0]  # the capacity taken and not given back
        self._release = weakref.finalize(self, _give_back, budget, self._charged)
        self._size = 0
        self._reserve(min(max(expected, 1), capacity_limit))

    def append(self, block: np.ndarray) -> None:
        end = self._size + block.size
        if end > self._array.size:
            if end > self._limit:
                raise ValueError(f"{end} samples are more than this buffer's {self._limit}")
            self._reserve(min(max(end, int(self._array.size * self.GROWTH)), self._limit))
        self._array[self._size : end] = block
        self._size = end

    def finish(self) -> np.ndarray:
        """The samples written: a view of the buffer, which keeps its whole capacity counted
        until it is freed."""
        self._release.detach()
        weakref.finalize(self._array, _give_back, self._budget, self._charged)
        return self._array[: self._size]

    def _reserve(self, capacity: int) -> None:
        old = self._array
        self._budget.take(capacity)  # raises before anything is allocated
        self._charged[0] += capacity
        self._array = np.empty(capacity, np.float32)
        self._array[: self._size] = old[: self._size]
        self._charged[0] -= old.size
        self._budget.give_back(old.size)


def _give_back(budget: SampleBudget, charged: list[int]) -> None:
    budget.give_back(charged[0])
