"""A stage's stream input for one request: chunks along stream_to edges, read by the backend.

The event loop puts chunks; the backend's compute thread iterates them (Request.stream()).
The stream ends when every stream_to predecessor has sent its end marker.
"""

from __future__ import annotations

import queue
from collections.abc import Iterable, Iterator

from omni_server.backend import RequestAborted
from omni_server.wire.messages import Payload, Timings

_END = object()
_ABORT = object()


class StreamInbox:
    def __init__(self, request_id: str, sources: Iterable[str]) -> None:
        self._request_id = request_id
        self._open = set(sources)
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._ended = False
        self.timings: Timings = []  # of the stream sources, from their end markers

    # ---- event-loop side
    def put(self, chunk: Payload) -> None:
        self._queue.put(chunk)

    def end(self, source: str, timings: Timings) -> None:
        self.timings.extend(timings)
        self._open.discard(source)
        if not self._open and not self._ended:
            self._ended = True
            self._queue.put(_END)

    def abort(self) -> None:
        self._ended = True
        self._queue.put(_ABORT)

    @property
    def ready(self) -> bool:
        """Reading will not block: a chunk is waiting or the stream has ended."""
        return self._ended or not self._queue.empty()

    @property
    def drained(self) -> bool:
        """The stream has ended and every chunk was read: the next read ends it (the backend's
        generator typically returns then). Only meaningful while no step of it runs."""
        return self._ended and self._queue.qsize() <= 1  # the sticky end marker alone

    # ---- compute-thread side
    def __iter__(self) -> Iterator[Payload]:
        while True:
            item = self._queue.get()
            if item is _END or item is _ABORT:
                self._queue.put(item)  # sticky: a second read ends (or aborts) the same way
            if item is _END:
                return
            if item is _ABORT:
                raise RequestAborted(self._request_id)
            yield item  # type: ignore[misc]
