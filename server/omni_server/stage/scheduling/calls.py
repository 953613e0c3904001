"""Backend calls as the schedulers make them, with the backend contract checked.

Every method runs on the stage's compute thread. Backend exceptions propagate to the scheduler,
which fails the request they belong to (torch's out-of-memory error arrives as `OutOfGPUMemory`,
the allocator's cache released: oom.py); contract violations (a wrong number of outputs, a
non-dict payload, a route naming an undeclared stage) raise `BackendContractError` naming
the stage.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from omni_server.backend import Request
from omni_server.compiler.plan import StageSpec
from omni_server.envelope import Payload

from .oom import guarded

# execute() outcome per request: (payload, next targets) or the exception that failed it
Outcome = tuple[Payload | None, tuple[str, ...]] | BaseException


class BackendContractError(RuntimeError):
    """The backend broke the stage-author contract (docs/backends.md)."""


class StageCalls:
    def __init__(self, spec: StageSpec, backend: Any) -> None:
        self.spec = spec
        self.backend = backend
        self._route = getattr(backend, spec.route) if spec.route else None
        self._merge = getattr(backend, spec.merge) if spec.merge else None

    def execute(self, requests: list[Request]) -> list[Outcome]:
        outputs = guarded(self.backend.execute, requests)
        if not isinstance(outputs, list | tuple) or len(outputs) != len(requests):
            got = len(outputs) if isinstance(outputs, list | tuple) else type(outputs).__name__
            raise BackendContractError(
                f"execute() must return a list with one output per request: "
                f"{len(requests)} requests, got {got}"
            )
        outcomes: list[Outcome] = []
        for request, output in zip(requests, outputs, strict=True):
            if isinstance(output, BaseException):
                outcomes.append(output)
                continue
            try:
                payload = self._check_payload(output, "execute() output")
                outcomes.append((payload, self.targets(request, payload)))
            except Exception as exc:  # noqa: BLE001 - a bad output or route fails its request only
                outcomes.append(exc)
        return outcomes

    def generate(self, request: Request) -> Iterator[Payload]:
        return self.backend.generate(request)

    def step(self, request: Request, generator: Iterator[Payload]) -> Any:
        """Advance one request's generator by one chunk.

        Returns ("chunk", chunk) or ("done", payload, targets); the backend's exceptions propagate.
        """
        try:
            chunk = guarded(next, generator)
        except StopIteration as stop:
            payload = None if stop.value is None else self._check_payload(stop.value, "return")
            return ("done", payload, self.targets(request, payload))
        return ("chunk", self._check_payload(chunk, "chunk"))

    @property
    def plays_media(self) -> bool:
        """The backend says how long its chunks play (playback-aware order: stream_order.py)."""
        return callable(getattr(self.backend, "playback_seconds", None))

    def playback_seconds(self, chunk: Payload) -> float:
        """Seconds of media in `chunk` (0 for a chunk the backend gives None for)."""
        seconds = self.backend.playback_seconds(chunk)
        if seconds is None:
            return 0.0
        if (
            not isinstance(seconds, int | float)
            or isinstance(seconds, bool)
            or not 0 <= seconds < float("inf")
        ):
            raise BackendContractError(
                f"playback_seconds() must return seconds >= 0 or None; got {seconds!r}"
            )
        return float(seconds)

    def close(self, request: Request, generator: Iterator[Payload]) -> None:
        close = getattr(generator, "close", None)
        if close is not None:
            close()

    # ---- "ar": continuous batching ----------------------------------------------------------

    def add(self, request: Request) -> None:
        guarded(self.backend.add, request)

    def abort(self, request: Request) -> None:
        self.backend.abort(request)

    @property
    def can_finish(self) -> bool:
        """The backend may end a request early (an optional `finish(request)`)."""
        return callable(getattr(self.backend, "finish", None))

    def finish(self, request: Request) -> None:
        guarded(self.backend.finish, request)

    def has_work(self) -> bool:
        """An ar backend fed by chunks that bounds its steps has work left that needs no new
        chunk (its optional `has_work()`, asked right after a step); False without one."""
        has_work = getattr(self.backend, "has_work", None)
        return bool(has_work()) if callable(has_work) else False

    def ar_step(self, requests: dict[int, Request]) -> list[tuple[Request, Outcome | Payload]]:
        """One engine step: (request, ("chunk", chunk) | outcome) for every request it moved.

        `requests` (id(request) -> request) are those the backend holds; an output naming
        another request breaks the contract. An outcome is (payload, targets) when the request
        finished, or the exception that failed it."""
        outputs = guarded(self.backend.step)
        if not isinstance(outputs, list | tuple):
            raise BackendContractError(
                f"step() must return a list of StepOutput, got {type(outputs).__name__}"
            )
        out: list[tuple[Request, Any]] = []
        for output in outputs:
            request: Request | None = getattr(output, "request", None)
            if request is None or requests.get(id(request)) is not request:
                raise BackendContractError(
                    "step() returned an output for a request the stage did not add() "
                    f"(got {type(output).__name__})"
                )
            assert request is not None
            try:
                if output.chunk is not None:
                    out.append((request, ("chunk", self._check_payload(output.chunk, "chunk"))))
                if output.error is not None:
                    out.append((request, output.error))
                elif output.finished:
                    result = output.result
                    payload = None if result is None else self._check_payload(result, "result")
                    out.append((request, (payload, self.targets(request, payload))))
            except Exception as exc:  # noqa: BLE001 - a bad output or route fails its request only
                out.append((request, exc))
        return out

    def finalize(self) -> None:
        finalize = getattr(self.backend, "finalize", None)
        if finalize is not None:
            finalize()

    def merge(self, request: Request, inputs: dict[str, Payload]) -> Payload:
        assert self._merge is not None
        merged = guarded(self._merge, request, inputs)
        return self._check_payload(merged, f"{self.spec.merge}()")

    def targets(self, request: Request, payload: Payload | None) -> tuple[str, ...]:
        """The `next` stages this request's payload goes to."""
        spec = self.spec
        if not spec.next:
            return ()
        if payload is None:
            raise BackendContractError(
                f"returned no payload, but the stage hands one to {', '.join(spec.next)}"
            )
        if self._route is None:
            return spec.next
        chosen = self._route(request, payload)
        if isinstance(chosen, str):
            targets: tuple[str, ...] = (chosen,)
        elif isinstance(chosen, list | tuple) and all(isinstance(t, str) for t in chosen):
            targets = tuple(chosen)
        else:
            raise BackendContractError(
                f"{spec.route}() must return a stage name or a list of names among next = "
                f"{list(spec.next)}, got {type(chosen).__name__}"
            )
        unknown = [t for t in targets if t not in spec.next]
        if unknown:
            raise BackendContractError(
                f"{spec.route}() chose {', '.join(map(repr, unknown))}, "
                f"not among next = {list(spec.next)}"
            )
        return targets

    @staticmethod
    def _check_payload(value: Any, what: str) -> Payload:
        if not isinstance(value, dict):
            raise BackendContractError(f"{what} must be a dict, got {type(value).__name__}")
        return value
