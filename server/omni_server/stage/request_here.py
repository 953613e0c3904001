"""A request's state at one stage (`StageNode`), as one record: what `abort` and the end of
the request drop whole."""

from __future__ import annotations

from dataclasses import dataclass, field

from omni_server.envelope import Payload, Timings

from .scheduling import WorkItem
from .streams import StreamInbox


class FanIn:
    """A `wait_for` stage's payloads of one request, gathered until every upstream sent one or
    skipped."""

    def __init__(self) -> None:
        self.payloads: dict[str, Payload] = {}
        self.skipped: set[str] = set()  # upstreams that will send no payload
        self.timings: Timings = []


@dataclass(eq=False)
class RequestHere:
    """One request's state at this stage, from its first message here to its end here: made by
    the first message (`StageNode._here_of`), dropped whole when the request completes, is skipped
    or is aborted here (`StageNode._end`, `StageNode.abort`), so nothing of it can outlive it.

    Before admission it gathers what starts it: the fan-in's payloads (`fan_in`, a `wait_for`
    stage), the upstreams that skipped it (`skips`), stream chunks that came first (`inbox`).
    Admitted, it holds the scheduler's `item` and who started it (`started_by`); `seq` numbers
    its chunks out."""

    fan_in: FanIn | None = None
    skips: set[str] = field(default_factory=set)
    inbox: StreamInbox | None = None
    item: WorkItem | None = None  # None until admitted
    started_by: str = ""  # the upstream whose message admitted it ("merge" after a fan-in)
    seq: int = 0  # the next chunk's number
