"""The Python backend API for stage authors (`model.py`).

A stage's `model.py` holds one class. The runtime creates it with no arguments, then calls:

    initialize(context)          once, before the stage reports ready; raise to refuse a config
    execute(requests) -> list    scheduler "single" / "batch": one output or exception per request
    generate(request)            scheduler "stream": a generator yielding chunks; its return value
                                 (if any) is the payload handed to `next`
    add(request)                 scheduler "ar" (continuous batching): a request joins the running
    step() -> list[StepOutput]   batch; one step advances every request it holds and says what
    abort(request)               each produced; abort drops a request and frees what it held
                                 (fed by `stream_to`: each step takes the chunks waiting for
                                 its requests with request.take_stream(), never blocking)
    finalize()                   once, at shutdown

plus, when the stage descriptor names them, a route method `route(request, outputs) -> str | list`
choosing among the declared `next` stages, and a merge method `merge(request, inputs) -> dict`
for fan-in (`wait_for`).

Payloads (request inputs, outputs, chunks) are dicts whose values are None, bool, int, float,
str, bytes, lists / tuples / dicts of those, numpy arrays or torch tensors. A stage treats its
inputs as read-only: inside one process the upstream stage's very objects are passed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_server.compiler.plan import ModelSpec
from omni_server.contracts import text_problem
from omni_server.envelope import Payload

__all__ = [
    "InvalidRequest",
    "Payload",
    "Request",
    "RequestAborted",
    "StageBackend",
    "StageConfigError",
    "StageContext",
    "StepOutput",
    "checked_text",
]


class StageConfigError(ValueError):
    """Raised by initialize() when the stage's parameters are not what it needs.

    The message says what was required and what was found; the runtime prefixes the stage name.
    """


class InvalidRequest(ValueError):
    """Raised by a backend when the request itself is at fault (the caller can fix it).

    The server answers 400 with OpenAI's error JSON: the message as given, `code` (e.g.
    "context_length_exceeded") and `param` (the request field at fault) when known. Anything
    else a backend raises is the server's fault (500)."""

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param

    def __reduce__(self) -> Any:  # keyword-only arguments need an explicit pickle recipe
        return (_invalid_request, (self.message, self.code, self.param))


def _invalid_request(message: str, code: str | None, param: str | None) -> InvalidRequest:
    return InvalidRequest(message, code=code, param=param)


def checked_text(text: str, param: str) -> str:
    """`text` when a codec can encode it, else InvalidRequest naming `param` (a 400): a stage
    that encodes a request's text (a tokenizer, a phonemizer) checks it with this first, so
    text the server's edges let through is still the caller's fault, never a 500."""
    problem = text_problem(text)
    if problem is not None:
        raise InvalidRequest(f"'{param}' {problem}", code="invalid_value", param=param)
    return text


class RequestAborted(Exception):
    """Raised inside a backend call when its request was aborted (client gone, pipeline failure)."""


@dataclass(frozen=True)
class StageContext:
    """What a backend learns about where it runs; handed to initialize()."""

    stage: str
    parameters: Mapping[str, Any]
    device: str  # "cpu" or "cuda:N"
    repository: Path
    stage_dir: Path
    replica: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    process_group: Any = None  # torch.distributed group of the TP ranks, None without TP
    engine: Mapping[str, Any] = field(default_factory=dict)  # the stage's [engine] table
    gpu_memory_fraction: float | None = None  # the share of the GPU this stage budgets
    # repository.toml's [parameters]: what every stage of the repository shares (a checkpoint
    # folder, say); the stage's own [parameters] are `parameters`
    repository_parameters: Mapping[str, Any] = field(default_factory=dict)
    # the served models whose requests visit this stage, by id, as the server resolved them
    # (command-line overrides included): their voices, default voice, language, aliases
    models: Mapping[str, ModelSpec] = field(default_factory=dict)
    # the runtime's weight sharing (gpu/weights.py); None: every replica loads its own
    weight_sharing: Any = field(default=None, repr=False, compare=False)
    # A private directory of this server run (mode 0700, removed with the run) where a backend
    # keeps what it prepared once for the processes after it: a replica restarted after a crash
    # or a freeze, another replica (the thinker's prepared weights, engine/prepared.py). None:
    # no such place (a backend driven outside a server).
    prepared_dir: Path | None = None

    def shared_weights(self, key: str, load: Callable[[], Mapping[str, Any]]) -> dict[str, Any]:
        """The tensors `load()` returns ({name: tensor} on this stage's device), loaded once
        per device when `weight_share = "on"` puts this replica in a sharing group: the lowest
        replica on the device (the leader) calls `load()` and publishes the tensors; the others
        (followers) get tensors aliasing the leader's memory and never call `load()`. Treat
        them as read-only (on the host a follower's are mapped read-only: a write faults).
        Without a group this is `dict(load())`. `key` (1-64 of [A-Za-z0-9_-]) names the set
        within the stage; leader and followers ask for the same keys."""
        if self.weight_sharing is None:
            return dict(load())
        result: dict[str, Any] = self.weight_sharing.share(self.stage, key, load)
        return result


@dataclass
class Request:
    """One request as a stage sees it."""

    id: str
    inputs: Payload
    # Chunks arriving over `stream_to` edges into this stage; filled by the runtime.
    _stream: Iterator[Payload] | None = field(default=None, repr=False)
    # An ar stage's non-blocking read of the same chunks (the runtime's StreamInbox.take)
    _take: Callable[[], tuple[list[Payload], bool]] | None = field(default=None, repr=False)
    _aborted: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def abort(self) -> None:
        """Mark the request aborted: what the runtime does when its caller goes away or another
        stage fails it. Running work sees it at its next `check_aborted()` or stream read (a
        test that drives a backend directly plays the runtime with it)."""
        self._aborted.set()

    def check_aborted(self) -> None:
        """Raise RequestAborted if the request was aborted; long loops call this between steps."""
        if self._aborted.is_set():
            raise RequestAborted(self.id)

    def stream(self) -> Iterator[Payload]:
        """Iterate the chunks streamed into this stage, in order, until the upstream end marker.

        Blocks between chunks; raises RequestAborted if the request is aborted meanwhile.
        A stage that is no `stream_to` target gets an empty iterator.
        """
        return self._stream if self._stream is not None else iter(())

    def take_stream(self) -> tuple[list[Payload], bool]:
        """The chunks streamed in since the last read, in order, and whether the stream has
        ended after them, without blocking: what an `ar` stage fed by `stream_to` calls in each
        `step()` (its scheduler steps when some request has chunks or its end waiting). Raises
        RequestAborted if the request was aborted. No stream: ([], True)."""
        if self._take is None:
            return [], True
        return self._take()


@dataclass
class StepOutput:
    """What one `step()` of an "ar" backend produced for one of its requests.

    `chunk` (if any) streams out at once (stream_to stages, or the caller when terminal). When
    `finished`, `result` is the request's final payload (handed to `next`, or the caller's
    result when terminal); `error`, when set, fails the request instead (InvalidRequest: 400)."""

    request: Request
    chunk: Payload | None = None
    finished: bool = False
    result: Payload | None = None
    error: BaseException | None = None


class StageBackend:
    """Optional base class: documents the interface and gives no-op initialize / finalize."""

    def initialize(self, context: StageContext) -> None:
        pass

    def finalize(self) -> None:
        pass
