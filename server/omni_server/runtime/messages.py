"""Every message between the coordinator and the stage hosts, as plain dataclasses.

One request's identity rides every message as an `Envelope`: its wire key (unique per runtime),
the caller's id, and its replica binding. Messages are the same objects whether they are passed
by reference (same process) or encoded by `codec` (another process).

Direction and channel (channels.py):
  coordinator -> host   Deliver (the entry payload)                        data (ring)
  host -> host          Deliver, Skipped, StreamChunk, StreamEnd           data (or a direct call)
  host -> coordinator   TerminalChunk, TerminalResult, TerminalSkipped,    data (ring)
                        StageFailed
  coordinator -> host   Abort, Shutdown                                    control (ZMQ)
  host -> coordinator   Ready, StartFailed                                 control (ZMQ)
Control never queues behind data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omni_server.envelope import Envelope, Payload, Timings

# ---- into stage hosts ------------------------------------------------------------------------


@dataclass(slots=True)
class Deliver:
    """A full payload for `stage`, from `source` (an upstream stage, or "" for the caller)."""

    env: Envelope
    stage: str
    source: str
    payload: Payload
    timings: Timings = field(default_factory=list)


@dataclass(slots=True)
class Skipped:
    """No payload from `source` for `stage`: a route method did not choose `stage`, or `source`
    was itself skipped (and then sends nothing else, so this also ends its stream edge)."""

    env: Envelope
    stage: str
    source: str


@dataclass(slots=True)
class StreamChunk:
    """One chunk along the stream edge `source` -> `stage`; `seq` counts from 0 per edge."""

    env: Envelope
    stage: str
    source: str
    seq: int
    chunk: Payload


@dataclass(slots=True)
class StreamEnd:
    """The end marker of the stream edge `source` -> `stage`: no chunk follows."""

    env: Envelope
    stage: str
    source: str
    timings: Timings = field(default_factory=list)


@dataclass(slots=True)
class Abort:
    """Drop these requests everywhere in the receiving process (late messages included)."""

    keys: tuple[int, ...]


@dataclass(slots=True)
class Shutdown:
    pass


# ---- to the coordinator ----------------------------------------------------------------------


@dataclass(slots=True)
class Ready:
    instance: str


@dataclass(slots=True)
class StartFailed:
    instance: str
    message: str


@dataclass(slots=True)
class TerminalChunk:
    key: int
    stage: str
    seq: int
    chunk: Payload


@dataclass(slots=True)
class TerminalResult:
    key: int
    stage: str
    payload: Payload | None
    timings: Timings


@dataclass(slots=True)
class TerminalSkipped:
    """The terminal `stage` was skipped for this request: it produces no result."""

    key: int
    stage: str


@dataclass(slots=True)
class StageFailed:
    key: int
    stage: str
    message: str  # "stage <name>: <what the backend raised>"; InvalidRequest: its message only
    # set when the backend raised InvalidRequest: the request's input is at fault
    invalid: bool = False
    error_code: str | None = None
    param: str | None = None


HostMessage = Deliver | Skipped | StreamChunk | StreamEnd | Abort | Shutdown
CoordinatorMessage = (
    Ready | StartFailed | TerminalChunk | TerminalResult | TerminalSkipped | StageFailed
)
