"""Replica binding: which replica of each replicated process serves a request, for its life.

A request is bound once, at admission, to one replica of every replicated process its model can
reach; every stage then sends its messages to the bound replica. The process's `binding` policy
picks: in turn (round robin, the reference design's rule) or the replica with the fewest requests
in flight (least loaded; ties rotate exactly like round robin).

Invariant: `load(p)[r]` == requests bound to replica r of p and not yet released. `bind` raises
it, `release` lowers it; the coordinator calls release exactly once per bound request.
"""

from __future__ import annotations

import threading

from omni_server.repository.plan import BindingPolicy, Plan


class ReplicaBinder:
    def __init__(self, plan: Plan) -> None:
        replicated = {n: p for n, p in plan.processes.items() if p.num_replicas > 1}
        self._policy = {n: p.binding for n, p in replicated.items()}
        self._cursor = dict.fromkeys(replicated, 0)  # the next replica in turn, per process
        self._load = {n: [0] * p.num_replicas for n, p in replicated.items()}
        # bind() and release() run on the event loop; the lock keeps the cursors and counts
        # exact should they ever be called from other threads too
        self._lock = threading.Lock()

    def bind(self, processes: tuple[str, ...]) -> dict[str, int]:
        """Choose a replica for each replicated process among `processes` and count it."""
        bindings = {}
        with self._lock:
            for process in processes:
                load = self._load.get(process)
                if load is None:
                    continue  # one replica: nothing to choose
                start = self._cursor[process]
                if self._policy[process] is BindingPolicy.LEAST_LOADED:
                    n = len(load)
                    replica = min(((start + i) % n for i in range(n)), key=load.__getitem__)
                else:
                    replica = start
                self._cursor[process] = (replica + 1) % len(load)
                load[replica] += 1
                bindings[process] = replica
        return bindings

    def release(self, bindings: dict[str, int]) -> None:
        with self._lock:
            for process, replica in bindings.items():
                self._load[process][replica] -= 1

    def load(self, process: str) -> tuple[int, ...]:
        """Requests in flight bound to each replica of a replicated process (a snapshot)."""
        with self._lock:
            return tuple(self._load[process])
