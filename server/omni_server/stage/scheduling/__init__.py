"""Scheduling: turns a stage's admitted requests into backend calls (single, batch, stream, ar)."""

from __future__ import annotations

import concurrent.futures

from omni_server.compiler.plan import SchedulerKind, SchedulerSpec

from .ar import ARScheduler
from .base import Scheduler, StageCallbacks, WorkItem
from .batch import BatchScheduler
from .calls import BackendContractError, StageCalls
from .stream import StreamScheduler, first_chunk_lane

__all__ = [
    "ARScheduler",
    "BackendContractError",
    "BatchScheduler",
    "Scheduler",
    "StageCallbacks",
    "StageCalls",
    "StreamScheduler",
    "WorkItem",
    "make_scheduler",
]


def make_scheduler(
    spec: SchedulerSpec,
    calls: StageCalls,
    callbacks: StageCallbacks,
    executor: concurrent.futures.ThreadPoolExecutor,
) -> Scheduler:
    if spec.kind is SchedulerKind.AR:
        return ARScheduler(calls, callbacks, executor)
    if spec.kind is SchedulerKind.STREAM:
        lane = first_chunk_lane(executor) if spec.first_chunk_lane else None
        return StreamScheduler(calls, callbacks, executor, first_chunk_lane=lane)
    if spec.kind is SchedulerKind.BATCH:
        return BatchScheduler(
            calls,
            callbacks,
            executor,
            max_batch_size=spec.max_batch_size,
            max_queue_delay_ms=spec.max_queue_delay_ms,
        )
    return BatchScheduler(calls, callbacks, executor)
