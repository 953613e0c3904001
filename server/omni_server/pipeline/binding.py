"""Replica binding: which replica of each replicated process serves a request, for its life.

A request is bound once, at admission, to one replica of every replicated process its model can
reach; every stage then sends its messages to the bound replica. The process's `binding` policy
picks: in turn (round robin, the reference design's rule) or the replica with the fewest requests
in flight (least loaded; ties rotate exactly like round robin).

Invariant: `load(p)[r]` == requests bound to replica r of p and not yet released. `bind` raises
it, `release` lowers it; the coordinator calls release exactly once per bound request.

Replicas that are down (dead, restarting, failed: the supervisor says so with `set_up`) are never
chosen; a process with no replica up makes `bind` raise `unavailable`.
"""

from __future__ import annotations

import threading

from omni_server.compiler.plan import BindingPolicy, Plan
from omni_server.errors import PipelineError


class ReplicaBinder:
    def __init__(self, plan: Plan) -> None:
        replicated = {n: p for n, p in plan.processes.items() if p.num_replicas > 1}
        self._policy = {n: p.binding for n, p in replicated.items()}
        self._cursor = dict.fromkeys(replicated, 0)  # the next replica in turn, per process
        self._load = {n: [0] * p.num_replicas for n, p in replicated.items()}
        self._up = {n: [True] * p.num_replicas for n, p in plan.processes.items()}
        # bind() and release() run on the event loop; the lock keeps the cursors and counts
        # exact should they ever be called from other threads too
        self._lock = threading.Lock()

    def bind(self, processes: tuple[str, ...]) -> dict[str, int]:
        """Choose a replica for each replicated process among `processes` and count it."""
        bindings = {}
        with self._lock:
            down = [p for p in processes if not any(self._up[p])]
            if down:
                replicas = ", ".join(f"{p}@r{r}" for p in down for r in range(len(self._up[p])))
                raise PipelineError(
                    f"no live replica of process {', '.join(down)} ({replicas}: restarting or "
                    "failed)",
                    code="unavailable",
                )
            for process in processes:
                load = self._load.get(process)
                if load is None:
                    continue  # one replica: nothing to choose
                up, n, start = self._up[process], len(load), self._cursor[process]
                live = [r for r in ((start + i) % n for i in range(n)) if up[r]]  # in turn
                if self._policy[process] is BindingPolicy.LEAST_LOADED:
                    replica = min(live, key=load.__getitem__)
                else:
                    replica = live[0]
                self._cursor[process] = (replica + 1) % n
                load[replica] += 1
                bindings[process] = replica
        return bindings

    def set_up(self, process: str, replica: int, up: bool) -> None:
        """Whether `replica` of `process` may take new requests (the supervisor's word)."""
        with self._lock:
            self._up[process][replica] = up

    def up(self, process: str) -> tuple[bool, ...]:
        with self._lock:
            return tuple(self._up[process])

    def release(self, bindings: dict[str, int]) -> None:
        with self._lock:
            for process, replica in bindings.items():
                self._load[process][replica] -= 1

    def load(self, process: str) -> tuple[int, ...]:
        """Requests in flight bound to each replica of a replicated process (a snapshot)."""
        with self._lock:
            return tuple(self._load[process])
