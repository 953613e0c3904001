"""Tensor-parallel stages: rank 0 leads, the other ranks mirror its backend calls in step.

Only rank 0 has a stage host (it talks to the coordinator and the other stages and runs the
scheduler). Before each backend call, on the stage's compute thread, it broadcasts the call as
an op (requests' ids and inputs, never backend objects) to its peers over a gloo control group;
every rank then makes the same call in the same order, so the collectives inside the backend
(the model's all-reduces, NCCL on GPUs) line up. Only rank 0's outputs are used. Routes and
merges run on rank 0 alone (they are not collective).

Staying in step (the invariants):
- Every rank's backend sees the same requests in the same states. The leader never hands its
  backend the scheduler's Request (whose abort flag the event loop sets at any moment) but a
  mirror: same id, same inputs, and an abort flag set only at a broadcast point (the abort op of
  the "ar" kind, or the flag each stream step / batch op carries), on every rank at once. A
  backend calling `request.check_aborted()` between collectives thus raises on all ranks or on
  none.
- An "ar" request without a seed gets one from the leader (where `contracts.seed_of` reads it:
  a chat's sampling seed, else `inputs["seed"]`; handed to the peers in the add op): every rank
  samples the same tokens from its own generator.
- After every op that runs backend code the ranks agree over the control group on who failed
  (an exception outside a collective, on any rank): if any rank failed, the call fails on every
  rank (a batch's or a step's requests fail with the leader's error or `TPRankFailed`, "ar"
  requests are aborted in every backend), so no rank carries state the others dropped.
- A failure inside a collective (a rank dies or hangs mid-all-reduce) cannot be undone in step.
  A dead rank closes its sockets: the others' next control collective raises and they exit
  (`_group_broken`); the runtime fails the group's requests as process_died (5xx), kills the
  remaining ranks and does not restart a TP group. A rank stuck in an NCCL collective is killed
  by NCCL's watchdog after the process group's timeout.

A TP stage cannot be a stream_to target: its peers would not see the chunks.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import secrets
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from omni_server.backend import Request, RequestAborted
from omni_server.compiler.plan import StageSpec
from omni_server.contracts import seed_of, with_seed

from .scheduling import StageCalls

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long a collective of the model's group may wait for the other ranks (NCCL's watchdog
# aborts the process after it; gloo raises).
MODEL_TIMEOUT = datetime.timedelta(seconds=120)
# The control group's broadcasts wait for the leader's next op however long the stage idles; a
# dead rank is noticed when its sockets close, not by this timeout.
CONTROL_TIMEOUT = datetime.timedelta(days=365)


class TPRankFailed(RuntimeError):
    """A backend call failed on another rank of the tensor-parallel group (the leader's own
    call succeeded): the requests it concerned fail on every rank."""


def init_process_group(rank: int, size: int, port: int, device: int | None) -> tuple[Any, Any]:
    """Join the stage's process group: (the group handed to the backend, the control group).

    The control group is a gloo group of its own even on the CPU, so the leader's ops and the
    ranks' agreements never interleave with the backend's collectives."""
    import torch.distributed as dist

    backend = "nccl" if device is not None else "gloo"
    kwargs: dict[str, Any] = {}
    if device is not None:
        import torch

        torch.cuda.set_device(device)
        kwargs["device_id"] = torch.device("cuda", device)  # NCCL connects now, not mid-graph
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=MODEL_TIMEOUT,
        **kwargs,
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return dist.group.WORLD, control


def _broadcast(op: Any, group: Any) -> Any:
    import torch.distributed as dist

    box = [op]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _agree(ok: bool, group: Any) -> list[int]:
    """Every rank says whether its call succeeded; returns the ranks that failed (same on all)."""
    import torch
    import torch.distributed as dist

    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int32)
    if not ok:
        flags[dist.get_rank(group)] = 1
    dist.all_reduce(flags, group=group)
    return [rank for rank, failed in enumerate(flags.tolist()) if failed]


def _group_broken(exc: BaseException) -> None:
    """A control collective failed: another rank is gone and this group can never be in step
    again. Exit now; the runtime fails the group's requests and stops its other ranks."""
    log.critical("tensor-parallel group broken (%s): exiting", exc)
    sys.stderr.flush()
    os._exit(1)


def _control(fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except RuntimeError as exc:  # gloo: the peer closed the connection or timed out
        _group_broken(exc)
        raise  # not reached


def _mirror(request_id: str, inputs: Any, aborted: bool = False) -> Request:
    mirror = Request(id=request_id, inputs=inputs)
    if aborted:
        mirror.abort()
    return mirror


def _attempt(fn: Callable[..., T], *args: Any) -> tuple[T | None, BaseException | None]:
    try:
        return fn(*args), None
    except Exception as exc:  # noqa: BLE001 - the group agrees on it before anyone acts on it
        return None, exc


class TPLeaderCalls(StageCalls):
    """Rank 0's backend calls: each one is announced to the peers first, on mirrored requests."""

    def __init__(self, spec: StageSpec, backend: Any, control_group: Any) -> None:
        super().__init__(spec, backend)
        self._group = control_group
        self._keys = itertools.count()
        # id(scheduler's request) -> (that request, the backend's mirror, op key): requests
        # held by the backend (a running generator, an added "ar" request)
        self._held: dict[int, tuple[Request, Request, int]] = {}
        # One op (broadcast, call, agreement) at a time, even from a second compute thread.
        self._lock = threading.Lock()

    # ---- control collectives -----------------------------------------------------------------

    def _announce(self, *op: Any) -> None:
        _control(_broadcast, op, self._group)

    def _failed_ranks(self, error: BaseException | None) -> list[int]:
        return _control(_agree, error is None, self._group)

    def _settle(self, error: BaseException | None) -> None:
        """After the agreement: raise the leader's own error, or TPRankFailed for a peer's."""
        failed = self._failed_ranks(error)
        if error is not None:
            raise error
        if failed:
            ranks = ", ".join(map(str, failed))
            raise TPRankFailed(f"stage {self.spec.name}: the call failed on TP rank(s) {ranks}")

    # ---- "single" / "batch" ------------------------------------------------------------------

    def execute(self, requests: list[Request]) -> list[Any]:
        with self._lock:
            mirrors = [_mirror(r.id, r.inputs, r.aborted) for r in requests]
            self._announce("execute", [(m.id, m.inputs, m.aborted) for m in mirrors])
            outcomes, error = _attempt(super().execute, mirrors)
            self._settle(error)
            assert outcomes is not None
            return outcomes  # routes ran on the mirrors: same ids and inputs

    # ---- "stream" ----------------------------------------------------------------------------

    def generate(self, request: Request) -> Iterator[Any]:
        with self._lock:
            key = next(self._keys)
            mirror = _mirror(request.id, request.inputs, request.aborted)
            self._announce("generate", key, mirror.id, mirror.inputs, mirror.aborted)
            generator, error = _attempt(super().generate, mirror)
            self._settle(error)
            self._held[id(request)] = (request, mirror, key)
            assert generator is not None
            return generator

    def step(self, request: Request, generator: Iterator[Any]) -> Any:
        with self._lock:
            _, mirror, key = self._held[id(request)]
            if request.aborted:  # the abort reaches every rank's mirror at this op
                mirror.abort()
            self._announce("step", key, mirror.aborted)
            result, error = _attempt(super().step, mirror, generator)
            failed = self._failed_ranks(error)
            if error is not None or failed or (result is not None and result[0] == "done"):
                del self._held[id(request)]  # the peers dropped theirs too
            if error is None and failed:
                super().close(mirror, generator)  # a peer failed: this rank's generator ends too
            if error is not None:
                raise error
            if failed:
                ranks = ", ".join(map(str, failed))
                raise TPRankFailed(f"stage {self.spec.name}: step failed on TP rank(s) {ranks}")
            return result

    def close(self, request: Request, generator: Iterator[Any]) -> None:
        with self._lock:
            entry = self._held.pop(id(request), None)
            if entry is None:
                return  # ended already, on every rank
            _, mirror, key = entry
            mirror.abort()
            self._announce("close", key)
            super().close(mirror, generator)

    # ---- "ar" --------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        with self._lock:
            key = next(self._keys)
            inputs = request.inputs
            if isinstance(inputs, dict) and seed_of(inputs) is None:
                # every rank must draw the same tokens: the leader picks the unseeded one's seed
                inputs = with_seed(inputs, secrets.randbits(63))
            mirror = _mirror(request.id, inputs)
            self._announce("add", key, mirror.id, inputs)
            _, error = _attempt(self.backend.add, mirror)
            failed = self._failed_ranks(error)
            if failed and error is None:
                _abort_quietly(self.backend, mirror)  # a peer refused it: no rank keeps it
            if error is not None:
                raise error
            if failed:
                ranks = ", ".join(map(str, failed))
                raise TPRankFailed(f"stage {self.spec.name}: add failed on TP rank(s) {ranks}")
            self._held[id(request)] = (request, mirror, key)

    def abort(self, request: Request) -> None:
        with self._lock:
            entry = self._held.pop(id(request), None)
            if entry is None:
                return
            _, mirror, key = entry
            mirror.abort()
            self._announce("abort", key)
            self.backend.abort(mirror)

    def ar_step(self, requests: dict[int, Request]) -> list[tuple[Request, Any]]:
        with self._lock:
            by_mirror = {id(self._held[i][1]): self._held[i] for i in requests}
            mirrors = {m: entry[1] for m, entry in by_mirror.items()}
            self._announce("ar_step")
            outputs, error = _attempt(super().ar_step, mirrors)
            failed = self._failed_ranks(error)
            if error is not None or failed:
                # The step's state differs between ranks: every rank aborts all it holds, and
                # every request of the step fails.
                if error is None:
                    ranks = ", ".join(map(str, failed))
                    error = TPRankFailed(
                        f"stage {self.spec.name}: step failed on TP rank(s) {ranks}"
                    )
                for original, mirror, _ in by_mirror.values():
                    self._held.pop(id(original), None)
                    _abort_quietly(self.backend, mirror)
                return [(entry[0], error) for entry in by_mirror.values()]
            assert outputs is not None
            out = []
            for mirror, outcome in outputs:
                original = by_mirror[id(mirror)][0]
                if not (isinstance(outcome, tuple) and outcome[0] == "chunk"):
                    self._held.pop(id(original), None)  # finished or failed: let go everywhere
                out.append((original, outcome))
            return out

    def finalize(self) -> None:
        with self._lock:
            self._announce("finalize")
            super().finalize()


def _abort_quietly(backend: Any, mirror: Request) -> None:
    _quietly("abort", backend.abort, mirror)


def _quietly(what: str, fn: Callable[..., object], *args: Any) -> None:
    """Cleanup that runs no collective (abort, close): its failure is logged, the request ends
    regardless, and the ranks stay in step."""
    try:
        fn(*args)
    except Exception:
        log.warning("TP: %s raised", what, exc_info=True)


def follow(calls: StageCalls, control_group: Any) -> None:
    """A peer rank's loop: make every call rank 0 announces, until it finalizes.

    Mirrors the leader's bookkeeping op by op (see TPLeaderCalls): the same requests held, the
    same abort flags at the same points, the same agreement after every call."""
    backend = calls.backend
    held: dict[int, tuple[Request, Iterator[Any] | None]] = {}  # op key -> mirror[, generator]

    def agree(error: BaseException | None) -> list[int]:
        if error is not None and not isinstance(error, RequestAborted):
            log.warning("TP peer: %s call failed", kind, exc_info=error)
        return _control(_agree, error is None, control_group)

    while True:
        op = _control(_broadcast, None, control_group)
        kind = op[0]
        if kind == "execute":
            mirrors = [_mirror(*entry) for entry in op[1]]
            agree(_attempt(backend.execute, mirrors)[1])
        elif kind == "generate":
            _, key, request_id, inputs, aborted = op
            mirror = _mirror(request_id, inputs, aborted)
            generator, error = _attempt(backend.generate, mirror)
            if not agree(error):
                held[key] = (mirror, generator)
        elif kind == "step":
            _, key, aborted = op
            mirror, generator = held[key]
            assert generator is not None
            if aborted:
                mirror.abort()
            result, error = _attempt(_advance, generator)
            failed = agree(error)
            if error is not None or failed or result:
                del held[key]
            if error is None and failed:
                calls.close(mirror, generator)
        elif kind == "close":
            entry = held.pop(op[1], None)
            if entry is not None and entry[1] is not None:
                entry[0].abort()
                _quietly("close", calls.close, *entry)
        elif kind == "add":
            _, key, request_id, inputs = op
            mirror = _mirror(request_id, inputs)
            _, error = _attempt(backend.add, mirror)
            failed = agree(error)
            if failed and error is None:
                _abort_quietly(backend, mirror)
            elif not failed:
                held[key] = (mirror, None)
        elif kind == "abort":
            entry = held.pop(op[1], None)
            if entry is not None:
                entry[0].abort()
                _abort_quietly(backend, entry[0])
        elif kind == "ar_step":
            outputs, error = _attempt(_ar_step, backend)
            if agree(error):
                for mirror, _ in held.values():
                    _abort_quietly(backend, mirror)
                held.clear()
            else:
                assert outputs is not None
                done = {id(o.request) for o in outputs if o.finished or o.error is not None}
                for key in [k for k, (m, _) in held.items() if id(m) in done]:
                    del held[key]
        elif kind == "finalize":
            calls.finalize()
            return
        else:
            raise ValueError(f"unknown TP op {kind!r}")


def _advance(generator: Iterator[Any]) -> bool:
    """One chunk of a peer's generator; True when it ended."""
    try:
        next(generator)
    except StopIteration:
        return True
    return False


def _ar_step(backend: Any) -> list[Any]:
    outputs = backend.step()
    if not isinstance(outputs, list | tuple):
        raise TypeError(f"step() must return a list of StepOutput, got {type(outputs).__name__}")
    return list(outputs)
