"""A stage's stream input for one request: chunks along stream_to edges, read by the backend.

The event loop puts chunks; the backend's compute thread reads them: a stream stage iterates
them (Request.stream(), blocking between chunks), an ar stage takes what is waiting at each
step (Request.take_stream(), never blocking). The stream ends when every stream_to predecessor
has sent its end marker.
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
        self._end_taken = False  # take() has reported the end: nothing is left to read
        # set by an ar scheduler on the event loop between steps (a terminal request out of
        # credit): take() reads nothing until it is cleared
        self.paused = False
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
        """Reading will not block: a chunk is waiting or the stream has ended (and take() has
        not reported that end yet)."""
        if self._end_taken:
            return False  # only the sticky end marker is queued
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

    def take(self) -> tuple[list[Payload], bool]:
        """The chunks waiting now, in order, and whether the stream has ended after them;
        never blocks. Raises RequestAborted once the request is aborted. While `paused`, it
        reads nothing (the chunks stay queued)."""
        chunks: list[Payload] = []
        if self.paused:
            return chunks, False
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return chunks, False
            if item is _END or item is _ABORT:
                self._queue.put(item)  # sticky, as for the iterator
            if item is _END:
                self._end_taken = True
                return chunks, True
            if item is _ABORT:
                raise RequestAborted(self._request_id)
            chunks.append(item)  # type: ignore[arg-type]
