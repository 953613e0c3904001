"""The shared-memory ring between two stage processes (one edge direction, SPSC).

A producer copies each record (a header plus N buffers) into the ring once; the consumer reads it
in place through memoryviews and releases it, in pop order, when done. Layout, ordering and
ownership: docs/transport.md.
"""

from __future__ import annotations

import asyncio
import collections
import math
import os
import secrets
import sys
import time
from collections.abc import Sequence
from typing import Any

from omni_transport._ffi import ffi, lib
from omni_transport.errors import RingError, RingFull, error_for

# How long an asyncio waiter sleeps between liveness checks while the peer has not attached yet
# (once it has, its pidfd is watched and death is seen at once), and at most once it has: a
# backstop, so that nothing (a lost wake-up, a bug) can stall a waiter for good.
_LIVENESS_POLL_S = 0.05
_BACKSTOP_S = 1.0
_DEFAULT_SPIN_US = 20.0
# pop_async polls the ring for a while before it sleeps on the doorbell when a record is expected
# soon: an event loop's wake-up from the doorbell costs ~100 us, more than most gaps of a busy
# stream. The poll does not hold the loop: it alternates short spins in C (_POLL_BURST_NS,
# pause + sched_yield) with a pass of the loop (asyncio.sleep(0)), so the loop's other tasks and
# I/O run between them, as they would while it slept; what it costs is that thread's core while
# it polls. How long it polls (docs/transport.md, "The hot-stream poll"):
# - adaptive (the default): each ring learns how long its pops wait for a record (an EWMA of
#   the waits, each counted at most _WAIT_CLAMP_NS so that a pause is forgotten in a few
#   records) and polls for 1.5 x that, at least _POLL_FLOOR_NS, but only while that bound is
#   at most the cap (OMNI_RING_HOT_POLL_MAX_US, default 1 ms): a sparser stream sleeps at once
#   and costs no poll at all;
# - fixed: OMNI_RING_HOT_SPIN_US (or Ring.hot_spin_us) polls that long whenever a record came
#   within _HOT_S (0: never poll), as before 2026-12-02.
_DEFAULT_HOT_POLL_MAX_US = 1000.0
_HOT_S = 0.002
_POLL_BURST_NS = 10_000
_POLL_FLOOR_NS = 50_000
_WAIT_CLAMP_NS = 4_000_000
_WAIT_EWMA_SHIFT = 2  # each wait moves the EWMA by 1/4 of its distance
# The contention check of the adaptive poll (as the C spin's, docs/transport.md "Waking up"): a
# burst of the poll that came back empty after more than its length plus _HELD_NS lost the core
# (or the GIL) to another task for that long. Then the next waits sleep at once: _SKIP_MIN of
# them, twice as many each time the poll after them is held again, at most _SKIP_MAX; a burst
# that ran its length unheld forgets that. A fixed poll (hot_spin_us) polls as it is told.
_HELD_NS = 20_000
_SKIP_MIN = 4
_SKIP_MAX = 256
_INLINE_BUFS = lib.OMNI_RECORD_INLINE_BUFS  # buffers described by the pop call itself
# Ring.wait_counts' keys, by their index in omni_ring_wait_counts' answer
_WAIT_COUNT_NAMES = {
    "spun": lib.OMNI_WAIT_SPUN,
    "handed_over": lib.OMNI_WAIT_HANDED_OVER,
    "slept": lib.OMNI_WAIT_SLEPT,
    "slept_at_once": lib.OMNI_WAIT_SLEPT_AT_ONCE,
}
_INT64_MAX = (1 << 63) - 1


def _word(field: str) -> int:
    """Index of a field of omni_record (all uint64_t words), from the header's layout."""
    return int(ffi.offsetof("omni_record", field)) // ffi.sizeof("uint64_t")


_END, _HEADER_OFF, _HEADER_LEN, _NBUFS = (
    _word(f) for f in ("end", "header_off", "header_len", "nbufs")
)
_BUF_OFF, _BUF_LEN = _word("buf_off"), _word("buf_len")


def _timeout_ns(timeout: float | None) -> int:
    """Seconds to the C library's int64 nanoseconds (-1: forever); a timeout beyond the int64
    range (about 292 years) is forever too."""
    if timeout is None:
        return -1
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout {timeout}: give seconds >= 0, or None to wait forever")
    if timeout * 1e9 >= _INT64_MAX:
        return -1
    return int(timeout * 1e9)


def unique_name(prefix: str) -> str:
    """prefix + 128 random bits: a segment name no other local user can guess and create first
    (/dev/shm is world-writable; attach also refuses a file that is not this user's)."""
    return f"{prefix}{secrets.token_hex(16)}"


class Record:
    """One popped record: zero-copy views into the ring, valid until release().

    The slot belongs to the consumer until the record is released; records are handed back to
    the producer in pop order (a record released early frees its space once all older records
    are released too). Do not use the views (or arrays built on them) after release."""

    __slots__ = ("_end", "_released", "_ring", "buffers", "header")

    def __init__(self, ring: Ring, end: int, header: memoryview, buffers: list[memoryview]):
        self._ring = ring
        self._end = end
        self._released = False
        self.header = header
        self.buffers = buffers

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._ring._release(self)

    def __enter__(self) -> Record:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        sizes = [b.nbytes for b in self.buffers]
        return f"Record(header={self.header.nbytes} B, buffers={sizes}, released={self._released})"


class Ring:
    """A handle on a named SPSC ring. One handle is one side: the first push() makes it the
    producer, the first pop() the consumer (or pass role= to create / attach). A handle belongs
    to one thread at a time; close() it from that thread."""

    def __init__(self, handle: Any, name: str, role: str | None, spin_us: float) -> None:
        self._h = handle
        self._pid = os.getpid()  # a forked child's copy of the handle must not close our side
        self._name = name
        self._capacity = int(lib.omni_ring_capacity(handle))
        self._outstanding: collections.deque[Record] = collections.deque()
        self._rec = ffi.new("omni_record *")
        self._words = ffi.cast("uint64_t *", self._rec)  # omni_record is all uint64_t words
        self._off = ffi.new("uint64_t *")
        self._len = ffi.new("uint64_t *")
        # the data area and its mirror as one read-only view: a record is a slice of it. Every
        # slice handed out keeps _area_obj referenced (through the view's managed buffer), which
        # is how close() knows whether views are still alive.
        self._area_obj = ffi.buffer(lib.omni_ring_data(handle), 2 * self._capacity)
        self._area: memoryview | None = memoryview(self._area_obj).toreadonly()
        self._bufs = ffi.new("void *[]", _INLINE_BUFS)  # push's argument arrays, reused
        self._lens = ffi.new("uint64_t[]", _INLINE_BUFS)
        self.spin_us = spin_us
        self._poll_skip = 0  # waits left whose pop_async sleeps at once (its core is contended)
        self._poll_backoff = 0
        self.contention_check = os.environ.get("OMNI_RING_SPIN_CONTENTION", "1") != "0"
        fixed = os.environ.get("OMNI_RING_HOT_SPIN_US")
        self.hot_spin_us = None if fixed is None else float(fixed)
        self.hot_poll_max_us = float(
            os.environ.get("OMNI_RING_HOT_POLL_MAX_US", _DEFAULT_HOT_POLL_MAX_US)
        )
        self._last_record = 0  # monotonic ns of the last record popped (0: none yet)
        # the EWMA of pop_async's waits for a record, ns; it starts as a stream that is neither
        # hot nor cold (a bound of 200 us, the fixed default before the adaptive poll)
        self._wait_ns = 133_000
        if role is not None:
            self.claim(role)

    @classmethod
    def create(
        cls,
        name: str,
        capacity: int = 64 << 20,
        *,
        role: str | None = None,
        spin_us: float = _DEFAULT_SPIN_US,
    ) -> Ring:
        """A fresh named segment (mode 0600); fails if the name exists. capacity is rounded up
        to a power of two of at least one page."""
        out = ffi.new("omni_ring **")
        rc = lib.omni_ring_create(name.encode(), capacity, out)
        if rc != lib.OMNI_OK:
            raise error_for(rc)
        return cls(out[0], name, role, spin_us)

    @classmethod
    def attach(
        cls, name: str, *, role: str | None = None, spin_us: float = _DEFAULT_SPIN_US
    ) -> Ring:
        """Opens an existing ring by name, from any process of the same user."""
        out = ffi.new("omni_ring **")
        rc = lib.omni_ring_attach(name.encode(), out)
        if rc != lib.OMNI_OK:
            raise error_for(rc)
        return cls(out[0], name, role, spin_us)

    @property
    def name(self) -> str:
        return self._name

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def spin_us(self) -> float:
        return self._spin_us

    @spin_us.setter
    def spin_us(self, value: float) -> None:
        """How long a blocking push / pop spins before it sleeps (0: sleep at once)."""
        if not 0 <= value <= 1e6:  # also refuses NaN
            raise ValueError(f"spin_us {value}: give 0 .. 1e6 microseconds")
        self._spin_us = float(value)
        lib.omni_ring_set_spin_ns(self._handle(), int(value * 1000))

    @property
    def contention_check(self) -> bool:
        """Whether the blocking spin and pop_async's poll watch for a contended core (the
        default; OMNI_RING_SPIN_CONTENTION=0 turns it off for new handles)."""
        return self._contention_check

    @contention_check.setter
    def contention_check(self, value: bool) -> None:
        """False: spin and poll as before 2026-12-03, to measure against."""
        self._contention_check = bool(value)
        self._poll_skip = self._poll_backoff = 0
        lib.omni_ring_set_contention_check(self._handle(), int(self._contention_check))

    @property
    def wait_counts(self) -> dict[str, int]:
        """What this handle's blocking waits (push waiting for room, pop for a record) did:
        spun (the event came during the spin), handed_over (of those: right after a yield that
        ran the peer on this core), slept, slept_at_once (of those: without spinning, the core
        found contended). pop_async's waits are not counted."""
        out = ffi.new("uint64_t[]", lib.OMNI_WAIT_COUNTS)
        lib.omni_ring_wait_counts(self._handle(), out)
        return {name: int(out[i]) for name, i in _WAIT_COUNT_NAMES.items()}

    @property
    def hot_spin_us(self) -> float | None:
        """The fixed poll of pop_async, microseconds (None: the adaptive poll)."""
        return None if self._hot_spin_ns is None else self._hot_spin_ns / 1000

    @hot_spin_us.setter
    def hot_spin_us(self, value: float | None) -> None:
        """A fixed poll: pop_async polls this long whenever a record came within 2 ms (0: never
        poll); None: the adaptive poll."""
        self._poll_skip = self._poll_backoff = 0
        if value is None:
            self._hot_spin_ns = None
            return
        if not 0 <= value <= 1e4:  # also refuses NaN; 10 ms would starve the loop
            raise ValueError(f"hot_spin_us {value}: give 0 .. 10000 microseconds, or None")
        self._hot_spin_ns = int(value * 1000)

    @property
    def hot_poll_max_us(self) -> float:
        """The adaptive poll's cap: a ring whose bound would exceed it does not poll."""
        return self._poll_max_ns / 1000

    @hot_poll_max_us.setter
    def hot_poll_max_us(self, value: float) -> None:
        if not 0 <= value <= 1e4:  # also refuses NaN
            raise ValueError(f"hot_poll_max_us {value}: give 0 .. 10000 microseconds")
        self._poll_max_ns = int(value * 1000)

    @property
    def hot_poll_us(self) -> float:
        """How long the next pop_async that finds the ring empty polls before it sleeps,
        microseconds (0: it sleeps at once)."""
        return self._poll_ns(time.monotonic_ns()) / 1000

    @property
    def typical_wait_us(self) -> float:
        """What the adaptive poll has learnt: the EWMA of pop_async's waits, microseconds."""
        return self._wait_ns / 1000

    def claim(self, role: str) -> None:
        """Takes the 'producer' or 'consumer' side now (push / pop do it on first use)."""
        code = {"producer": lib.OMNI_PRODUCER, "consumer": lib.OMNI_CONSUMER}.get(role)
        if code is None:
            raise ValueError(f"role {role!r}: 'producer' or 'consumer'")
        self._check(lib.omni_ring_claim(self._handle(), code))

    # ---- producer ----

    def push(
        self, header: bytes, buffers: Sequence[Any] = (), timeout: float | None = None
    ) -> None:
        """Copies header and buffers (any C-contiguous buffer objects) into one record.
        Blocks while the ring is full; timeout=0 raises RingFull at once. Raises RingTimeout,
        RingClosed (the consumer closed or died), RecordTooLarge."""
        h = self._h
        if h is None:
            h = self._handle()
        tns = -1 if timeout is None else _timeout_ns(timeout)
        if not isinstance(header, bytes):
            header = ffi.from_buffer(header)
        n = len(buffers)
        if not n:
            rc = lib.omni_ring_push(h, header, len(header), ffi.NULL, ffi.NULL, 0, tns)
        elif n == 1:  # the usual record (one payload): no list of views
            view = ffi.from_buffer(buffers[0])  # pins the buffer until the call returns
            bufs, lens = self._bufs, self._lens
            bufs[0] = view
            lens[0] = len(view)
            rc = lib.omni_ring_push(h, header, len(header), bufs, lens, 1, tns)
        else:
            # the views keep the buffers pinned until the call returns
            views = [ffi.from_buffer(b) for b in buffers]
            if n > len(self._lens):
                self._bufs = ffi.new("void *[]", n)
                self._lens = ffi.new("uint64_t[]", n)
            bufs, lens = self._bufs, self._lens
            for i, v in enumerate(views):
                bufs[i] = v
                lens[i] = len(v)
            rc = lib.omni_ring_push(h, header, len(header), bufs, lens, n, tns)
        if rc:
            raise error_for(rc)

    # ---- consumer ----

    def pop(self, timeout: float | None = None) -> Record:
        """The next record; blocks until one arrives. Raises RingTimeout, or RingClosed once
        the producer closed or died and every record it published was popped."""
        h = self._h
        if h is None:
            h = self._handle()
        tns = -1 if timeout is None else _timeout_ns(timeout)
        rc = lib.omni_ring_pop(h, tns, self._rec)
        if rc:
            raise error_for(rc)
        return self._record()

    def try_pop(self) -> Record | None:
        """The next record, or None when the ring is empty (RingClosed when the ring is drained
        and the producer closed or died)."""
        rc = lib.omni_ring_pop(self._handle(), 0, self._rec)
        if rc == lib.OMNI_EEMPTY:
            return None
        if rc != lib.OMNI_OK:
            raise error_for(rc)
        return self._record()

    async def pop_async(self) -> Record:
        """pop() for asyncio: the loop watches the ring's doorbell fd (and the producer's
        pidfd), no thread. The producer rings the doorbell only after this side declared it is
        going to sleep, so a busy stream costs no system call per record. When a record is
        expected soon it polls first (hot_poll_us; the constants above say how long)."""
        rec = self.try_pop()
        if rec is not None:
            self._learn(0)
            return rec
        began = time.monotonic_ns()
        bound = self._poll_ns(began)
        if bound:
            rec = await self._poll_hot(began + bound)
        elif self._poll_skip:
            self._poll_skip -= 1
        while rec is None:
            await self._sleep_until_progress()
            rec = self.try_pop()
        self._learn(time.monotonic_ns() - began)
        return rec

    def _poll_ns(self, now: int) -> int:
        """The poll before the next sleep, ns (0: none)."""
        fixed = self._hot_spin_ns
        if fixed is not None:
            return fixed if now - self._last_record < _HOT_S * 1e9 else 0
        if self._poll_skip:  # its core was found contended
            return 0
        bound = max(self._wait_ns + (self._wait_ns >> 1), _POLL_FLOOR_NS)
        return bound if bound <= self._poll_max_ns else 0

    def _learn(self, wait_ns: int) -> None:
        """One pop's wait for its record (0: it was there) into the EWMA of waits."""
        self._last_record = time.monotonic_ns()
        wait = min(wait_ns, _WAIT_CLAMP_NS)
        self._wait_ns += (wait - self._wait_ns) >> _WAIT_EWMA_SHIFT

    async def _poll_hot(self, deadline: int) -> Record | None:
        """The poll: short C spins until `deadline` (monotonic ns), each after a pass of the
        loop (its other ready tasks and I/O first); the record, or None when none came."""
        while True:
            await asyncio.sleep(0)
            start = time.monotonic_ns()
            burst = min(_POLL_BURST_NS, max(deadline - start, 1))
            rec = self._spin_pop(burst)
            now = time.monotonic_ns()
            if rec is not None:
                return rec
            if self._contention_check and self._hot_spin_ns is None:  # (a fixed poll: as told)
                if now - start > burst + _HELD_NS:  # the core was taken from us that long
                    self._poll_backoff = min(max(2 * self._poll_backoff, _SKIP_MIN), _SKIP_MAX)
                    self._poll_skip = self._poll_backoff
                    return None
                self._poll_backoff = 0
            if now >= deadline:
                return None

    def _spin_pop(self, spin_ns: int) -> Record | None:
        rc = lib.omni_ring_spin_pop(self._handle(), spin_ns, self._rec)
        if rc == lib.OMNI_EEMPTY:
            return None
        if rc != lib.OMNI_OK:
            raise error_for(rc)
        return self._record()

    async def push_async(self, header: bytes, buffers: Sequence[Any] = ()) -> None:
        """push() for asyncio: while the ring is full, waits on this side's doorbell (rung by
        the consumer's release) and the consumer's pidfd, without blocking the loop."""
        while True:
            try:
                self.push(header, buffers, timeout=0)
                return
            except RingFull:
                pass
            await self._sleep_until_progress()

    async def _sleep_until_progress(self) -> None:
        """Declares this side asleep and waits for the peer's progress (or its end); returns
        at once when the peer made progress while we armed."""
        h = self._handle()
        rc = lib.omni_ring_arm(h)
        if rc == lib.OMNI_EFULL:  # progress already: no need to sleep
            return
        if rc != lib.OMNI_OK:
            raise error_for(rc)
        loop = asyncio.get_running_loop()
        bell = lib.omni_ring_doorbell_fd(h)
        peer = lib.omni_ring_peer_fd(h)
        woken = loop.create_future()

        def wake() -> None:
            if not woken.done():
                woken.set_result(None)

        loop.add_reader(bell, wake)
        if peer >= 0:
            loop.add_reader(peer, wake)
        try:
            # without the peer's pidfd yet, look again now and then (it may never attach)
            await asyncio.wait([woken], timeout=_BACKSTOP_S if peer >= 0 else _LIVENESS_POLL_S)
        finally:
            loop.remove_reader(bell)
            if peer >= 0:
                loop.remove_reader(peer)
            lib.omni_ring_disarm(h)

    def peer_gone(self) -> bool:
        """True once the peer closed its side or died (a peer that never came is not gone)."""
        return bool(lib.omni_ring_peer_gone(self._handle()))

    def _record(self) -> Record:
        # the C library's validated copy: every slice lies within the area
        w = self._words
        area = self._area
        if area is None:
            raise RingError(f"ring {self._name!r} is closed")
        hoff = w[_HEADER_OFF]
        header = area[hoff : hoff + w[_HEADER_LEN]]
        n = w[_NBUFS]
        if n == 1:  # the usual record (one payload)
            off = w[_BUF_OFF]
            buffers = [area[off : off + w[_BUF_LEN]]]
        elif n <= _INLINE_BUFS:
            buffers = []
            for i in range(n):
                off = w[_BUF_OFF + i]
                buffers.append(area[off : off + w[_BUF_LEN + i]])
        else:
            buffers = []
            for i in range(n):
                self._check(lib.omni_record_buffer(self._h, self._rec, i, self._off, self._len))
                buffers.append(area[self._off[0] : self._off[0] + self._len[0]])
        rec = Record(self, w[_END], header, buffers)
        self._outstanding.append(rec)
        return rec

    def _release(self, rec: Record) -> None:
        # Space returns to the producer only up to the oldest record still held.
        out = self._outstanding
        end = None
        while out and out[0]._released:
            end = out.popleft()._end
        if end is not None and self._h is not None:
            rc = lib.omni_ring_release(self._h, end)
            if rc:
                raise error_for(rc)

    @property
    def held(self) -> int:
        """Records popped and not yet released."""
        return sum(not r._released for r in self._outstanding)

    # ---- lifetime ----

    def close(self) -> None:
        """Closes this side: a blocked peer gets RingClosed; the segment is unlinked when the
        last user closes. If views of records (or arrays over them) are still alive, the memory
        stays mapped until the process exits, so they do not crash; they stay readable but no
        longer belong to anyone."""
        if self._h is not None and self._pid == os.getpid():
            h, self._h = self._h, None
            self._outstanding.clear()
            if self._area is not None:
                self._area.release()
                self._area = None
            # ours plus getrefcount's argument; more means a handed-out view is alive
            views_alive = sys.getrefcount(self._area_obj) > 2
            lib.omni_ring_close_ex(h, int(views_alive))

    @property
    def closed(self) -> bool:
        return self._h is None

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ring({self._name!r}, capacity={self._capacity}, closed={self.closed})"

    def _handle(self) -> Any:
        if self._h is None:
            raise RingError(f"ring {self._name!r} is closed")
        return self._h

    @staticmethod
    def _check(rc: int) -> None:
        if rc != lib.OMNI_OK:
            raise error_for(rc)


def unlink_leftovers(prefix: str) -> list[str]:
    """Removes /dev/shm segments named prefix* that no live process uses (crash cleanup; the
    supervisor calls it). Segments with a live user are left alone. Returns the names removed."""
    out = ffi.new("char[]", 1 << 16)
    removed = ffi.new("int *")
    rc = lib.omni_unlink_leftovers(prefix.encode(), out, len(out), removed)
    if rc != lib.OMNI_OK:
        raise error_for(rc)
    names = ffi.unpack(out, len(out)).split(b"\0")
    return [n.decode() for n in names[: removed[0]] if n]
