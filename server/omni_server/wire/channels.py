"""The data plane between processes: one SHM ring per (sender, receiver) pair, plus ZMQ.

Each process binds one ZMQ PULL socket (`ipc://<run dir>/<endpoint>.sock`) and owns the rings
it receives on (it creates them before it reports ready; a sender attaches on first use).
- Data messages (payloads, chunks, end markers, results) go on the ring of their pair, so they
  arrive in the order they were sent. A message larger than the ring goes over ZMQ instead,
  and a small "spilled" marker takes its place in the ring to keep that order.
- Control messages (abort, shutdown, ready) go on ZMQ: they never wait behind data.

Sends never block the event loop: when a ring is full the message waits in the sender's backlog
(order kept) and one task per ring drains it with `Ring.push_async`, which sleeps on the ring's
doorbell (rung by the receiver's release) and the receiver's pidfd: no polling. Received
buffers are copied out of the ring once and the record released at once, so a slow stage never
holds ring space.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from omni_transport import RecordTooLarge, Ring, RingClosed, RingFull, TransportError

from .codec import decode, encode
from .cuda_lane import CudaExporter, _Lane

log = logging.getLogger(__name__)

COORDINATOR = "c"  # the coordinator's endpoint name; stage processes are named by instance index

_CONTROL = b"C"
_SPILL = b"S"

# Bytes of data messages this process received, by path (ring records; spills of records too
# large for the ring, over the socket). Tests read it to show what did and did not cross the
# host, e.g. that a CUDA tensor crossed as a small IPC record instead of its contents.
received_bytes = {"ring": 0, "spill": 0}


class _Spilled:
    """Ring marker for a message that went over ZMQ: (sender, seq) finds it there."""

    __slots__ = ("sender", "seq")

    def __init__(self, sender: str, seq: int) -> None:
        self.sender = sender
        self.seq = seq

    def __reduce__(self) -> Any:
        return (_Spilled, (self.sender, self.seq))


def ring_name(run_id: str, sender: str, receiver: str) -> str:
    return f"omni-{run_id}-{sender}-{receiver}"


def socket_path(run_dir: Path, endpoint: str) -> str:
    return f"ipc://{run_dir}/{endpoint}.sock"


class Endpoint:
    """One process's side of the network: its PULL socket, its rings, its senders."""

    def __init__(
        self,
        run_dir: Path,
        run_id: str,
        name: str,
        ring_capacity: int,
        peer_devices: dict[str, frozenset[int]] | None = None,
    ) -> None:
        """`peer_devices`: the GPUs each receiver uses (CUDA IPC engages towards those)."""
        self.run_dir = run_dir
        self.run_id = run_id
        self.name = name
        self.ring_capacity = ring_capacity
        self._ctx = zmq.asyncio.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(socket_path(run_dir, name))
        self._pushes: dict[str, zmq.asyncio.Socket] = {}
        self._outlets: dict[str, _RingOutlet] = {}
        self._inbound: dict[str, Ring] = {}
        self._spills: dict[tuple[str, int], asyncio.Future[Any]] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._ring_tasks: dict[str, asyncio.Task[Any]] = {}  # inbound ring -> its receiver
        self._receiving: tuple[Callable[[Any], None], Callable[[asyncio.Task[Any]], None]] | None
        self._receiving = None
        self._cuda: CudaExporter | None = None
        if peer_devices and any(peer_devices.values()):
            self._cuda = CudaExporter(f"omni-{run_id}-{name}", peer_devices)

    # ---- receiving ---------------------------------------------------------------------------

    def create_inbound(self, senders: list[str]) -> None:
        """Create the rings that `senders` will write to us (before we report ready)."""
        for sender in senders:
            name = ring_name(self.run_id, sender, self.name)
            self._inbound[sender] = Ring.create(name, self.ring_capacity, role="consumer")

    def start_receiving(
        self, handle: Callable[[Any], None], on_broken: Callable[[BaseException], None]
    ) -> None:
        """Run `handle(message)` on the loop for every message that arrives, in arrival order
        per sender (ring messages) and per socket (control messages). If a receiver fails (a
        message that cannot be decoded or handled: a bug), `on_broken` is told."""
        loop = asyncio.get_running_loop()

        def done(task: asyncio.Task[None]) -> None:
            if not task.cancelled() and task.exception() is not None:
                log.error("%s: receiver failed", self.name, exc_info=task.exception())
                on_broken(task.exception())  # type: ignore[arg-type]

        self._receiving = (handle, done)
        task = loop.create_task(self._receive_socket(handle))
        task.add_done_callback(done)
        self._tasks.append(task)
        for sender in self._inbound:
            self._start_ring(sender)

    def _start_ring(self, sender: str) -> None:
        assert self._receiving is not None
        handle, done = self._receiving
        task = asyncio.get_running_loop().create_task(
            self._receive_ring(sender, self._inbound[sender], handle)
        )
        task.add_done_callback(done)
        self._tasks.append(task)
        self._ring_tasks[sender] = task

    def add_inbound(self, sender: str) -> None:
        """A new sender after start_receiving (a restarted peer under its new name): create its
        ring and receive from it."""
        self.create_inbound([sender])
        if self._receiving is not None:
            self._start_ring(sender)

    async def forget_peer(self, peer: str) -> None:
        """Drop everything towards and from `peer` (a dead process): its outlet and backlog,
        the PUSH socket to it, the ring it sent us (unread records are dropped)."""
        outlet = self._outlets.pop(peer, None)
        if outlet is not None:
            await outlet.stop()
            outlet.close()
        sock = self._pushes.pop(peer, None)
        if sock is not None:
            sock.close(linger=0)
        task = self._ring_tasks.pop(peer, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            self._tasks.remove(task)
        ring = self._inbound.pop(peer, None)
        if ring is not None:
            ring.close()
        for key in [k for k in self._spills if k[0] == peer]:
            del self._spills[key]

    async def _receive_socket(self, handle: Callable[[Any], None]) -> None:
        while True:
            frames = await self._pull.recv_multipart(copy=False)
            kind = frames[0].bytes
            if kind == _CONTROL:
                handle(decode(frames[1].bytes, [f.buffer for f in frames[2:]]))
            elif kind == _SPILL:
                sender, seq = frames[1].bytes.decode(), int(frames[2].bytes)
                received_bytes["spill"] += sum(len(f.buffer) for f in frames[3:])
                message = decode(frames[3].bytes, [f.buffer for f in frames[4:]])
                self._spill_future((sender, seq)).set_result(message)
            else:
                raise ValueError(f"unknown frame kind {kind!r} on {self.name}")

    def _spill_future(self, key: tuple[str, int]) -> asyncio.Future[Any]:
        fut = self._spills.get(key)
        if fut is None:
            fut = self._spills[key] = asyncio.get_running_loop().create_future()
        return fut

    async def _receive_ring(self, sender: str, ring: Ring, handle: Callable[[Any], None]) -> None:
        while True:
            try:
                record = await ring.pop_async()
            except RingClosed:
                return  # the sender is gone; the supervisor reports its death
            # copy out and release at once: arrays must outlive the record, ring space must not
            buffers = [bytearray(b) for b in record.buffers]
            received_bytes["ring"] += len(record.header) + sum(len(b) for b in buffers)
            message = decode(record.header, buffers)
            record.release()
            if isinstance(message, _Spilled):
                key = (message.sender, message.seq)
                message = await self._spill_future(key)
                del self._spills[key]
            handle(message)

    # ---- sending -----------------------------------------------------------------------------

    def send_data(self, receiver: str, message: Any) -> None:
        outlet = self._outlets.get(receiver)
        if outlet is None:
            name = ring_name(self.run_id, self.name, receiver)
            try:
                ring = Ring.attach(name, role="producer")
            except TransportError as exc:
                # no such receiver now (a dead peer whose successor has not created its rings):
                # drop the message, cache nothing, so a send after the restart attaches anew
                log.warning("ring %s: no receiver (%s), dropping a message", name, exc)
                return
            lane = self._cuda.for_receiver(receiver) if self._cuda is not None else None
            outlet = self._outlets[receiver] = _RingOutlet(self, receiver, name, lane)
            outlet._ring = ring
        outlet.send(message)

    def send_control(self, receiver: str, message: Any, linger: float = 0.0) -> None:
        """`linger`: how long close() may still spend delivering this message to a live peer
        (a last word before the process exits, such as StartFailed); by default close() drops
        what is undelivered, so a dead peer never holds us up."""
        header, buffers = encode(message)
        sock = self._push(receiver)
        if linger > 0:
            sock.setsockopt(zmq.LINGER, int(linger * 1000))
        sock.send_multipart([_CONTROL, header, *buffers], copy=False)

    def _spill(self, receiver: str, seq: int, header: bytes, buffers: list[Any]) -> None:
        frames = [_SPILL, self.name.encode(), str(seq).encode(), header, *buffers]
        self._push(receiver).send_multipart(frames, copy=False)

    def _push(self, receiver: str) -> zmq.asyncio.Socket:
        sock = self._pushes.get(receiver)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # never block: the loop must not stall on a peer
            sock.connect(socket_path(self.run_dir, receiver))
            self._pushes[receiver] = sock
        return sock

    def backlog(self, receiver: str) -> int:
        """Messages to `receiver` waiting for room in its ring (0: all in the ring, nothing sent
        yet, or the receiver is gone and they were dropped)."""
        outlet = self._outlets.get(receiver)
        return len(outlet.backlog) if outlet is not None else 0

    async def flush(self, timeout: float = 2.0) -> None:
        """Wait (at most `timeout` seconds) until every backlog is in its ring."""
        waits = [o.drained.wait() for o in self._outlets.values() if not o.drained.is_set()]
        if waits:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*waits), timeout)

    async def close(self) -> None:
        # waiters first: a pop or push waiting on a ring's doorbell must be gone before the
        # ring (and its fds) is closed
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(o.stop() for o in self._outlets.values()))
        for outlet in self._outlets.values():
            outlet.close()
        for ring in self._inbound.values():
            ring.close()
        if self._cuda is not None:
            self._cuda.close()
        for sock in self._pushes.values():
            sock.close()  # with the socket's LINGER: 0 unless a last word was sent on it
        self._pull.close(linger=0)
        self._ctx.term()  # returns once every lingering message is delivered or timed out


class _RingOutlet:
    """The sending side of one ring: ordered, never blocking, spilling what does not fit.

    Invariant: while `backlog` is non-empty, new messages queue behind it (order) and exactly
    one drain task is pushing its head; `drained` is set exactly when the backlog is empty (or
    its drain failed: a bug, raised by the next send)."""

    def __init__(
        self, endpoint: Endpoint, receiver: str, name: str, cuda: _Lane | None = None
    ) -> None:
        self._endpoint = endpoint
        self._cuda = cuda
        self._receiver = receiver
        self._name = name
        self._ring: Ring | None = None
        self._seq = 0
        self.backlog: collections.deque[tuple[bytes, list[Any]]] = collections.deque()
        self.drained = asyncio.Event()
        self.drained.set()
        self._drain: asyncio.Task[None] | None = None
        self._failed: BaseException | None = None
        self._closed = False

    def send(self, message: Any) -> None:
        if self._failed is not None:
            raise RuntimeError(f"ring {self._name}: sending failed") from self._failed
        if self._closed:
            return
        header, buffers = encode(message, self._cuda)
        if self.backlog:
            self.backlog.append((header, buffers))
            return
        left = self._try(header, buffers)
        if left is not None:
            self.backlog.append(left)
            self.drained.clear()
            self._drain = asyncio.get_running_loop().create_task(self._drain_backlog())
            self._drain.add_done_callback(self._drain_done)

    def _try(self, header: bytes, buffers: list[Any]) -> tuple[bytes, list[Any]] | None:
        """Push one message now; returns what must wait in the backlog (None: nothing)."""
        if self._closed:
            return None
        if self._ring is None:
            self._ring = Ring.attach(self._name, role="producer")
        try:
            self._ring.push(header, buffers, timeout=0)
        except RingFull:
            return (header, buffers)
        except RecordTooLarge:
            seq, self._seq = self._seq, self._seq + 1
            self._endpoint._spill(self._receiver, seq, header, buffers)
            marker, _ = encode(_Spilled(self._endpoint.name, seq))
            return self._try(marker, [])
        except RingClosed:
            self._receiver_gone()
        return None

    def _receiver_gone(self) -> None:
        # the receiver died: its death fails the requests concerned; drop what we send it
        log.warning("ring %s: receiver gone, dropping messages", self._name)
        self._closed = True

    async def _drain_backlog(self) -> None:
        assert self._ring is not None  # _try attached it before anything was backlogged
        try:
            while self.backlog and not self._closed:
                # the head was refused for lack of space only (a spilled message left just its
                # marker), so it fits once the receiver releases enough
                try:
                    await self._ring.push_async(*self.backlog[0])
                except RingClosed:
                    self._receiver_gone()
                    break
                self.backlog.popleft()
                # push what fits now without a doorbell round trip; stop at the first refusal
                while self.backlog and not self._closed:
                    left = self._try(*self.backlog[0])
                    if left is not None:
                        self.backlog[0] = left
                        break
                    self.backlog.popleft()
        finally:
            if self._closed:
                self.backlog.clear()

    def _drain_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            # a bug (push_async raises nothing else for a record that fits): the backlog is
            # stuck, so the next send to this receiver raises it
            self._failed = task.exception()
            log.error("ring %s: backlog drain failed", self._name, exc_info=self._failed)
        if not self.backlog or self._failed is not None:
            self.drained.set()

    async def stop(self) -> None:
        """Stop sending: drop the backlog and wait until no push waits on the ring's doorbell
        (its fds must stay open until then)."""
        self._closed = True
        if self._drain is not None:
            self._drain.cancel()
            await asyncio.gather(self._drain, return_exceptions=True)
        self.backlog.clear()
        self.drained.set()

    def close(self) -> None:
        """Close the ring; after stop() (a drain still waiting on its doorbell would outlive
        the fds it watches)."""
        assert self._drain is None or self._drain.done(), "close() before stop()"
        if self._ring is not None:
            self._ring.close()
