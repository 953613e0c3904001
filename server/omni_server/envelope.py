"""What travels with every request between stages: its payloads, its identity, its timings.

A leaf module: the stage-author API (`backend`), the schedulers and the runtime all import it,
and it imports nothing of theirs, so imports run one way (runtime -> scheduling -> envelope).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# A request's inputs, a stage's output, a stream chunk: a dict of plain values, arrays, tensors.
Payload = dict[str, Any]

# (stage, queue_seconds, compute_seconds, min_lead_seconds) of every stage a request passed,
# carried downstream; min_lead_seconds is NaN except at a stream stage whose chunks are media
# (stage/scheduling/stream_order.py: how close its listener came to running out of audio)
Timings = list[tuple[str, float, float, float]]


@dataclass(slots=True)
class Envelope:
    """One request's identity as it rides every message between the coordinator and stages."""

    key: int  # the request's wire identity, unique for the runtime's life
    id: str  # the caller's request id (what backends see as Request.id)
    # replicated logical process -> the replica chosen at admission; absent means replica 0
    bindings: dict[str, int] = field(default_factory=dict)
    # the request's model: which stages it visits, so what each stage waits for ("" = all)
    model: str = ""
