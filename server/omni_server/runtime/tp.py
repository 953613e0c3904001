"""Tensor-parallel stages: rank 0 leads, the other ranks mirror its backend calls.

Only rank 0 has a stage host (it talks to the coordinator and the other stages and runs the
scheduler). Before each backend call, on the stage's compute thread, it broadcasts the call
(requests' ids and inputs, never backend objects) to its peers over a gloo group; every rank
then makes the same call in the same order, so collectives inside the backend line up. Only
rank 0's outputs are used. Routes and merges run on rank 0 alone (they are not collective).

A TP stage cannot be a stream_to target: its peers would not see the chunks.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterator
from typing import Any

from omni_server.backend import Request
from omni_server.compiler.plan import StageSpec
from omni_server.scheduling import StageCalls

log = logging.getLogger(__name__)


def init_process_group(rank: int, size: int, port: int, device: int | None) -> tuple[Any, Any]:
    """Join the stage's process group: (the group handed to the backend, the control group)."""
    import torch.distributed as dist

    backend = "nccl" if device is not None else "gloo"
    if device is not None:
        import torch

        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=120),
    )
    control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return dist.group.WORLD, control


def _broadcast(op: Any, group: Any) -> Any:
    import torch.distributed as dist

    box = [op]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class TPLeaderCalls(StageCalls):
    """Rank 0's backend calls: each one is announced to the peers first."""

    def __init__(self, spec: StageSpec, backend: Any, control_group: Any) -> None:
        super().__init__(spec, backend)
        self._group = control_group

    def execute(self, requests: list[Request]) -> list[Any]:
        _broadcast(("execute", [(r.id, r.inputs) for r in requests]), self._group)
        return super().execute(requests)

    def generate(self, request: Request) -> Iterator[Any]:
        _broadcast(("generate", id(request), request.id, request.inputs), self._group)
        return super().generate(request)

    def step(self, request: Request, generator: Iterator[Any]) -> Any:
        _broadcast(("step", id(request)), self._group)
        return super().step(request, generator)

    def close(self, request: Request, generator: Iterator[Any]) -> None:
        _broadcast(("close", id(request)), self._group)
        super().close(request, generator)

    def finalize(self) -> None:
        _broadcast(("finalize",), self._group)
        super().finalize()


def follow(calls: StageCalls, control_group: Any) -> None:
    """A peer rank's loop: make every call rank 0 announces, until it finalizes."""
    generators: dict[int, tuple[Request, Iterator[Any]]] = {}
    while True:
        op = _broadcast(None, control_group)
        kind = op[0]
        # The leader sees the same exception from the same call and fails the request; a peer
        # only has to stay in step with it, so it logs and carries on.
        try:
            if kind == "execute":
                calls.backend.execute([Request(id=rid, inputs=inputs) for rid, inputs in op[1]])
            elif kind == "generate":
                request = Request(id=op[2], inputs=op[3])
                generators[op[1]] = (request, calls.backend.generate(request))
            elif kind == "step":
                request, generator = generators[op[1]]
                try:
                    next(generator)
                except StopIteration:
                    generators.pop(op[1])
            elif kind == "close":
                entry = generators.pop(op[1], None)
                if entry is not None:
                    calls.close(*entry)
            elif kind == "finalize":
                calls.finalize()
                return
            else:
                raise ValueError(f"unknown TP op {kind!r}")
        except Exception:
            if kind in ("step", "generate"):
                generators.pop(op[1], None)
            log.warning("TP peer: %s call failed", kind, exc_info=True)
