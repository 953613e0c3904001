"""Heartbeats: how the server tells a frozen stage process from a busy one.

Each stage process runs a `HeartbeatSender` thread that sends a one-byte datagram to the
server's `HeartbeatMonitor` every interval. The thread shares nothing with the stage's compute
threads or its event loop, so a backend busy for minutes still beats; a process that beats no
more is stopped (SIGSTOP), stuck in a call that holds the GIL, or otherwise frozen, and the
monitor reports it once its deadline passes (the supervisor kills it, and restarts it). Deadlines
apply once a process is ready: before that, loading a model may hold the GIL for long, and the
start timeout bounds it.

Who sent a beat is read from the kernel (SCM_CREDENTIALS), never from the datagram: a beat is
counted only for a pid the monitor watches and only from our own user. The socket lives in the
private run directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

SOCKET_NAME = "heartbeat.sock"
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class HeartbeatMonitor:
    """The server's side: deadlines per watched pid, checked on the event loop.

    `on_silent(pid)` is called once for a watched pid whose deadline passed (then it is no longer
    watched). A watched pid's deadline is `grace_s` after watch() while it starts (loading a
    model may hold the GIL for long: start() has its own timeout); from arm() on (it is ready)
    each beat moves it to `timeout_s` from now."""

    def __init__(self, run_dir: Path, timeout_s: float, on_silent: Callable[[int], None]) -> None:
        self.path = run_dir / SOCKET_NAME
        self.timeout_s = timeout_s
        self._on_silent = on_silent
        self._deadlines: dict[int, float] = {}
        self._armed: set[int] = set()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._sock.bind(str(self.path))
        self._sock.setblocking(False)
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.fileno(), self._drain)
        self._schedule()

    def watch(self, pid: int, grace_s: float) -> None:
        self._deadlines[pid] = time.monotonic() + grace_s

    def arm(self, pid: int) -> None:
        """`pid` is ready: from now on it must beat every `timeout_s`."""
        if pid in self._deadlines:
            self._armed.add(pid)
            self._deadlines[pid] = time.monotonic() + self.timeout_s

    def forget(self, pid: int) -> None:
        self._deadlines.pop(pid, None)
        self._armed.discard(pid)

    def _drain(self) -> None:
        """Read every waiting beat (non-blocking)."""
        uid = os.getuid()
        while True:
            try:
                _, ancillary, _, _ = self._sock.recvmsg(8, socket.CMSG_SPACE(_UCRED.size))
            except (BlockingIOError, InterruptedError):
                return
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid, sender_uid, _ = _UCRED.unpack(data[: _UCRED.size])
                    if sender_uid == uid and pid in self._armed:
                        self._deadlines[pid] = time.monotonic() + self.timeout_s

    def _schedule(self) -> None:
        assert self._loop is not None
        self._timer = self._loop.call_later(max(self.timeout_s / 4, 0.02), self._check)

    def _check(self) -> None:
        self._drain()  # beats that queued while the loop was busy count before any verdict
        now = time.monotonic()
        silent = [pid for pid, deadline in self._deadlines.items() if deadline < now]
        for pid in silent:
            self.forget(pid)
            self._on_silent(pid)
        self._schedule()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        with contextlib.suppress(OSError):
            self.path.unlink()


class HeartbeatSender:
    """The stage process's side: a daemon thread beating every `interval_s` until stop()."""

    def __init__(self, path: Path, interval_s: float) -> None:
        self._path = path
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)  # a stalled server must not stall this thread
            while True:
                # the server may be gone (we die with it) or its buffer full: a missed beat
                # is what the deadline is for
                with contextlib.suppress(OSError):
                    sock.sendto(b"\x01", str(self._path))
                if self._stop.wait(self._interval_s):
                    return

    def stop(self) -> None:
        self._stop.set()
