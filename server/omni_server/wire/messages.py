"""Every message between the coordinator and the stage hosts, as plain dataclasses.

One request's identity rides every message as an `Envelope`: its wire key (unique per runtime),
the caller's id, and its replica binding. Messages are the same objects whether they are passed
by reference (same process) or encoded by `codec` (another process).

Direction and channel (channels.py):
  coordinator -> host   Deliver (the entry payload)                        data (ring)
  host -> host          Deliver, Skipped, StreamChunk, StreamChunks,       data (or a direct call)
                        StreamEnd
  host -> coordinator   TerminalChunk, TerminalResult, TerminalSkipped,    data (ring)
                        StageFailed
  coordinator -> host   Abort, Shutdown, Rewire, Credit                    control (ZMQ)
  host -> coordinator   Ready, StartFailed, Rewired, StageTimedOut         control (ZMQ)
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


# the most chunks one StreamChunks may carry: a step of a batch far larger than any engine's
# (the sender splits above it; a receiver refuses more)
MAX_BATCHED_CHUNKS = 4096


class MalformedMessage(ValueError):
    """A received message whose fields break its invariants: refused whole, nothing of it
    delivered."""


@dataclass(slots=True)
class StreamChunks:
    """One step's chunks of several requests along the stream edges `source` -> `stage`, as one
    message: an `ar` stage's step sends one per destination process instead of one per request
    (each crossing costs the loops far more than its bytes). The receiver splits it back into
    its `StreamChunk`s, in order (`split_chunks`), as if they had come one by one."""

    stage: str
    source: str
    chunks: tuple[StreamChunk, ...]


def split_chunks(message: StreamChunks) -> tuple[StreamChunk, ...]:
    """The chunks of a received batch, checked: each a StreamChunk of this edge (same stage and
    source) with an Envelope and a seq >= 0, 1..MAX_BATCHED_CHUNKS of them; else
    MalformedMessage (the whole batch is refused: a sender that breaks these is a bug or
    hostile, and half a step delivered would leave streams out of step)."""
    stage, source, chunks = message.stage, message.source, message.chunks
    if type(stage) is not str or type(source) is not str:
        raise MalformedMessage("StreamChunks: stage and source must be strings")
    if type(chunks) is not tuple or not 0 < len(chunks) <= MAX_BATCHED_CHUNKS:
        raise MalformedMessage(
            f"StreamChunks: chunks must be a tuple of 1..{MAX_BATCHED_CHUNKS} chunks"
        )
    for chunk in chunks:
        if type(chunk) is not StreamChunk or type(chunk.env) is not Envelope:
            raise MalformedMessage(f"StreamChunks: an entry is a {type(chunk).__name__}")
        if chunk.stage != stage or chunk.source != source:
            raise MalformedMessage(
                f"StreamChunks {source} -> {stage}: an entry of {chunk.source} -> {chunk.stage}"
            )
        if type(chunk.env.key) is not int or type(chunk.seq) is not int or chunk.seq < 0:
            raise MalformedMessage("StreamChunks: an entry's key and seq must be integers >= 0")
    return chunks


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


# a terminal stage may have this many chunks of one request sent to the coordinator and not yet
# taken by the request's consumer (credits.md in runtime.md: back-pressure to slow readers)
CHUNK_WINDOW = 16
UNLIMITED = -1


@dataclass(slots=True)
class Credit:
    """The consumer of request `key` took `chunks` chunks of terminal `stage`: it may send that
    many more (UNLIMITED: the consumer reads only the result, so chunks are not paced)."""

    key: int
    stage: str
    chunks: int


@dataclass(slots=True)
class Rewire:
    """Instance `index` restarts under the endpoint name `new` (it was `old`): drop the rings
    and sockets of `old` (create the inbound ring from `new` if it sends to us), then answer
    Rewired. The supervisor spawns the successor only once every live peer answered."""

    index: int
    old: str
    new: str


# ---- to the coordinator ----------------------------------------------------------------------


@dataclass(slots=True)
class Ready:
    instance: str


@dataclass(slots=True)
class StartFailed:
    instance: str
    message: str


@dataclass(slots=True)
class Rewired:
    instance: str  # who answers
    index: int  # the restarting instance it rewired to


@dataclass(slots=True)
class StageTimedOut:
    """Requests that stayed at `stage` longer than its timeout_s (the host aborted them there).
    `overran`: a backend call has run past timeout_s, so the stage's compute thread is stuck
    (a Python thread cannot be cancelled): the supervisor kills the process."""

    instance: str
    stage: str
    keys: tuple[int, ...]
    timeout_s: float
    overran: bool = False


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


HostMessage = (
    Deliver | Skipped | StreamChunk | StreamChunks | StreamEnd | Abort | Shutdown | Rewire | Credit
)
CoordinatorMessage = (
    Ready
    | StartFailed
    | Rewired
    | StageTimedOut
    | TerminalChunk
    | TerminalResult
    | TerminalSkipped
    | StageFailed
)
