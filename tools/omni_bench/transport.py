"""Transport benchmark: the shared-memory ring against the usual ways to move bytes between two
processes on one host, and (with --cuda) a CUDA tensor crossing processes.

    python -m omni_bench.transport [--quick] [--runs N] [--markdown FILE] [--cuda | --contention]

For each payload size it measures, between two processes:
- round trip: the payload one way, an 8-byte acknowledgement back (median of many);
- one-way GB/s: a burst of payloads, the receiver acknowledges the last one.
Methods: the ring at its default settings (the adaptive spin) and with no spin; its reader
either reads every byte in place (one pass of numpy max over the views) or copies the payload
out (bytearray, what the runtime does); pyzmq PAIR over ipc:// (copying and zero-copy); a new
multiprocessing.shared_memory segment per message (the reference system's relay: create, copy
in, send the name, open, copy out, unlink); multiprocessing.Queue with a pickled numpy array;
and the floor: one in-process memcpy (np.copyto) of the same size. Everything runs --runs
times; a cell is the median of the runs and their range. Then the 64 B round trip again with
one core kept busy (a process spinning: a stage computing), against pyzmq in the same run.
--contention measures only that 64 B round trip, quiet and with one core busy in each run, for
the ring at its defaults, the ring without its contention check (the spin before 2026-12-03),
the ring with no spin, and pyzmq: the spin policy measured both ways in one run.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

from omni_bench.harness import tables
from omni_bench.harness.timing import machine_line, percentile

SIZES = [64, 4 << 10, 64 << 10, 1 << 20, 16 << 20]
RTT_MAX = 64 << 10  # round trips are measured up to this size; GB/s from 64 KiB up
DEFAULT_SPIN_US = 20.0  # the ring's default (omni_transport.ring), named in the tables
RING_SPINS = [DEFAULT_SPIN_US, 0.0]
WARM_BYTES = 64 << 20  # warm-up bytes: at least one lap of the ring (first touches fault)
RUNTIME_RING = 8 << 20  # the runtime's ring capacity (Runtime(ring_capacity=...) default)


def ring_capacity(sizes: list[int]) -> int:
    """The runtime's 8 MiB, or room for two records of the largest payload when that is more
    (a record must fit; two let the producer fill one while the reader reads the other)."""
    cap = RUNTIME_RING
    while cap < 2 * (max(sizes) + 4096):
        cap <<= 1
    return cap


def _label(size: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size >> shift} {unit}"
    return f"{size} B"


# ---- the methods: a client (this process) and a server (the other process) ----


class Method:
    """One way to move a payload. The server half runs in a spawned process."""

    name = ""
    rtt = True  # measure round trips (else only throughput)

    def __init__(self, tag: str):
        self.tag = tag

    def client_open(self) -> None: ...
    def server_open(self) -> None: ...
    def send(self, payload: np.ndarray) -> None: ...
    def recv(self) -> None: ...  # server: take one payload and consume it
    def ack(self) -> None: ...  # server -> client
    def wait_ack(self) -> None: ...
    def close(self) -> None: ...


class RingMethod(Method):
    """The ring. reader "read": one read pass over each buffer in place (numpy max), then
    release; "copy": copy each buffer out (bytearray), then release."""

    def __init__(
        self,
        tag: str,
        reader: str = "read",
        rtt: bool = True,
        capacity: int = 0,
        contention_check: bool = True,
    ):
        super().__init__(tag)
        self.capacity = capacity or RUNTIME_RING
        self.reader = reader
        self.rtt = rtt
        self.name = "ring" if reader == "read" else "ring, reader copies out"
        self.spin_us = DEFAULT_SPIN_US
        self.contention_check = contention_check  # False: the spin before 2026-12-03
        self.ack_waits: dict[str, int] = {}  # the client's waits for acks (Ring.wait_counts)
        from omni_transport import unique_name

        self.names = (unique_name("omni-bench-"), unique_name("omni-bench-"))

    def client_open(self) -> None:
        from omni_transport import Ring

        self.data = Ring.create(self.names[0], self.capacity, role="producer")
        self.back = Ring.create(self.names[1], 1 << 20, role="consumer")
        self.set_spin(self.spin_us)
        self.data.contention_check = self.back.contention_check = self.contention_check

    def server_open(self) -> None:
        from omni_transport import Ring

        self.data = Ring.attach(self.names[0], role="consumer")
        self.back = Ring.attach(self.names[1], role="producer")
        self.set_spin(self.spin_us)
        self.data.contention_check = self.back.contention_check = self.contention_check

    def set_spin(self, spin_us: float) -> None:
        self.data.spin_us = self.back.spin_us = spin_us

    def send(self, payload: np.ndarray) -> None:
        self.data.push(b"", (payload,))

    def recv(self) -> None:
        rec = self.data.pop()
        for buf in rec.buffers:
            if self.reader == "read":
                np.frombuffer(buf, np.uint8).max()  # every byte read where it lies
            else:
                bytearray(buf)
        rec.release()

    def ack(self) -> None:
        self.back.push(b"ack12345")

    def wait_ack(self) -> None:
        self.back.pop().release()

    def close(self) -> None:
        self.ack_waits = self.back.wait_counts
        self.data.close()
        self.back.close()


class ZmqMethod(Method):
    def __init__(self, tag: str, copy: bool):
        super().__init__(tag)
        self.copy = copy
        self.name = "pyzmq ipc copy" if copy else "pyzmq ipc zero-copy"
        # abstract namespace ("@"): no socket file is left behind, in /tmp or anywhere
        self.addr = f"ipc://@omni-bench-{tag}-{os.getpid()}"

    def _open(self, bind: bool) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        if bind:
            self.sock.bind(self.addr)
        else:
            self.sock.connect(self.addr)

    def client_open(self) -> None:
        self._open(True)

    def server_open(self) -> None:
        self._open(False)

    def send(self, payload: np.ndarray) -> None:
        self.sock.send(payload.data, 0, self.copy)  # the array's buffer, as pyzmq takes it

    def recv(self) -> None:
        self.sock.recv(copy=self.copy)

    def ack(self) -> None:
        self.sock.send(b"ack12345")

    def wait_ack(self) -> None:
        self.sock.recv()

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


class SegmentPerMessage(ZmqMethod):
    """The reference system's relay: a fresh segment per message, its name over a socket."""

    def __init__(self, tag: str):
        super().__init__(tag, copy=True)
        self.name = "shm segment per message"

    def send(self, payload: np.ndarray) -> None:
        shm = shared_memory.SharedMemory(create=True, size=payload.nbytes)
        assert shm.buf is not None  # None only once closed
        np.frombuffer(shm.buf, np.uint8)[:] = payload
        # the receiver unlinks it: keep this process's resource tracker out of it
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        self.sock.send_string(shm.name)
        shm.close()

    def recv(self) -> None:
        shm = shared_memory.SharedMemory(name=self.sock.recv_string())
        assert shm.buf is not None  # None only once closed
        view = np.frombuffer(shm.buf, np.uint8)
        np.array(view)  # copy out: the segment goes away
        del view
        shm.close()
        shm.unlink()


class QueueMethod(Method):
    name = "multiprocessing.Queue"

    def __init__(self, tag: str):
        super().__init__(tag)
        ctx = mp.get_context("spawn")
        self.q, self.back = ctx.Queue(), ctx.Queue()

    def send(self, payload: np.ndarray) -> None:
        self.q.put(payload)

    def recv(self) -> None:
        self.q.get()

    def ack(self) -> None:
        self.back.put(b"ack12345")

    def wait_ack(self) -> None:
        self.back.get()


def _server(method: Method, ctl: Any) -> None:
    ctl.recv()  # the client has created its end
    method.server_open()
    ctl.send("ready")
    while True:
        cmd = ctl.recv()
        if cmd is None:
            break
        mode, n, spin = cmd
        if spin is not None:
            method.set_spin(spin)  # type: ignore[attr-defined]
        ctl.send("go")
        for i in range(n):
            method.recv()
            if mode == "rtt" or i == n - 1:
                method.ack()
    method.close()


def _measure(method: Method, sizes: list[int], quick: bool, spins: list[float | None]) -> dict:
    """{(kind, size, spin): value}: round-trip seconds (median) or one-way bytes/second."""
    ctx = mp.get_context("spawn")
    ctl, ctl_child = ctx.Pipe()
    proc = ctx.Process(target=_server, args=(method, ctl_child), daemon=True)
    proc.start()  # before client_open: the method is pickled without open handles
    results: dict = {}
    try:
        method.client_open()
        ctl.send("open")
        if not ctl.poll(60):
            raise RuntimeError(f"{method.name}: server did not start")
        ctl.recv()
        for size in sizes:
            payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            if size <= RTT_MAX and method.rtt:
                n = 300 if quick else 3000
                for spin in spins:
                    if spin is not None:
                        method.set_spin(spin)  # type: ignore[attr-defined]
                    ctl.send(("rtt", n, spin))
                    ctl.recv()
                    times = []
                    for _ in range(n):
                        t0 = time.perf_counter()
                        method.send(payload)
                        method.wait_ack()
                        times.append(time.perf_counter() - t0)
                    results[("rtt", size, spin)] = statistics.median(times[n // 10 :])
            if size >= RTT_MAX:
                total = (64 if quick else 512) << 20
                n = max(8, min(20000, total // size))
                # warm-up: one lap of the ring (its first touches are page faults), and a few
                # messages for the other methods; then the steady state is timed
                warm = max(2, WARM_BYTES // size)
                for spin in spins[:1]:
                    ctl.send(("tput", n + warm, spin))
                    ctl.recv()
                    for _ in range(warm):
                        method.send(payload)
                    t0 = time.perf_counter()
                    for _ in range(n):
                        method.send(payload)
                    method.wait_ack()
                    results[("gbps", size, None)] = n * size / (time.perf_counter() - t0)
        ctl.send(None)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        if not isinstance(method, QueueMethod):
            method.close()
    return results


def _memcpy_floor(sizes: list[int], quick: bool) -> dict:
    out = {}
    for size in sizes:
        src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        dst = np.empty_like(src)
        n = max(5, min(20000, ((64 if quick else 512) << 20) // size))
        np.copyto(dst, src)
        t0 = time.perf_counter()
        for _ in range(n):
            np.copyto(dst, src)
        out[("gbps", size, None)] = n * size / (time.perf_counter() - t0)
    return out


def _burn() -> None:
    while True:
        pass


def _plan(tag: str) -> list[tuple[Method, list[float | None]]]:
    return [
        (RingMethod(tag + "r"), list(RING_SPINS)),
        (RingMethod(tag + "c", reader="copy", rtt=False), [DEFAULT_SPIN_US]),
        (ZmqMethod(tag + "zc", copy=True), [None]),
        (ZmqMethod(tag + "zz", copy=False), [None]),
        (SegmentPerMessage(tag + "s"), [None]),
        (QueueMethod(tag + "q"), [None]),
    ]


def run_cpu(sizes: list[int], quick: bool, runs: int, progress: Callable[[str], None]) -> str:
    """Every method, `runs` times over; then the 64 B round trip with one core busy."""
    per_run: list[dict[str, dict]] = []
    for run in range(runs):
        rows: dict[str, dict] = {}
        for method, spins in _plan(uuid.uuid4().hex[:8]):
            progress(f"run {run + 1}/{runs}: {method.name} ...")
            if isinstance(method, RingMethod):
                # one ring per capacity class: 8 MiB (the runtime's) for what fits twice
                fits = [s for s in sizes if ring_capacity([s]) == RUNTIME_RING]
                rest = [s for s in sizes if s not in fits]
                rows[method.name] = {}
                for part in (fits, rest):
                    if part:
                        ring = RingMethod(
                            uuid.uuid4().hex[:8], method.reader, method.rtt, ring_capacity(part)
                        )
                        rows[method.name].update(_measure(ring, part, quick, spins))
            else:
                rows[method.name] = _measure(method, sizes, quick, spins)
        rows["memcpy floor (in-process)"] = _memcpy_floor(sizes, quick)
        per_run.append(rows)
    busy_runs: list[dict[str, dict]] = []
    burner = mp.get_context("spawn").Process(target=_burn, daemon=True)
    burner.start()
    try:
        for run in range(runs):
            tag = uuid.uuid4().hex[:8]
            progress(f"run {run + 1}/{runs}, one core busy ...")
            busy_runs.append(
                {
                    "ring": _measure(RingMethod(tag + "r"), [64], quick, list(RING_SPINS)),
                    "pyzmq ipc copy": _measure(
                        ZmqMethod(tag + "z", copy=True), [64], quick, [None]
                    ),
                }
            )
    finally:
        burner.kill()
        burner.join()
    return _tables(per_run, busy_runs, sizes, runs)


# ---- the spin under CPU contention: the 64 B round trip, quiet and one core busy, both policies

CONTENTION_ROWS = (
    ("ring (default: adaptive spin 20 us, contention check)", True, DEFAULT_SPIN_US),
    ("ring (adaptive spin 20 us, no contention check: before 2026-12-03)", False, DEFAULT_SPIN_US),
    ("ring (no spin)", True, 0.0),
    ("pyzmq ipc copy", None, None),
)


def _contention_round(quick: bool) -> tuple[dict[str, float], dict[str, dict[str, int]]]:
    """One round of every row of CONTENTION_ROWS: {label: 64 B round-trip seconds}, and for the
    ring rows what the client's waits for the acknowledgement did (Ring.wait_counts)."""
    tag = uuid.uuid4().hex[:8]
    rtt: dict[str, float] = {}
    waits: dict[str, dict[str, int]] = {}
    for i, (label, check, spin) in enumerate(CONTENTION_ROWS):
        if check is None:  # pyzmq
            got = _measure(ZmqMethod(f"{tag}z{i}", copy=True), [64], quick, [None])
        else:
            ring = RingMethod(f"{tag}r{i}", contention_check=check)
            got = _measure(ring, [64], quick, [spin])
            waits[label] = ring.ack_waits
        rtt[label] = got[("rtt", 64, spin)]
    return rtt, waits


def run_contention(quick: bool, runs: int, progress: Callable[[str], None]) -> str:
    """`runs` rounds, each quiet then with one core busy (a process spinning), every row of
    CONTENTION_ROWS in each: the spin policy both ways, against pyzmq, in the same minutes."""
    per: dict[str, list[dict[str, float]]] = {"quiet": [], "busy": []}
    waits: dict[str, dict[str, dict[str, int]]] = {"quiet": {}, "busy": {}}

    def one(kind: str) -> None:
        rtt, counts = _contention_round(quick)
        per[kind].append(rtt)
        for label, c in counts.items():
            total = waits[kind].setdefault(label, dict.fromkeys(c, 0))
            for k, v in c.items():
                total[k] += v

    for run in range(runs):
        progress(f"run {run + 1}/{runs}: quiet ...")
        one("quiet")
        progress(f"run {run + 1}/{runs}: one core busy ...")
        burner = mp.get_context("spawn").Process(target=_burn, daemon=True)
        burner.start()
        try:
            one("busy")
        finally:
            burner.kill()
            burner.join()
    span = f"median of {runs} runs (range)" if runs > 1 else "one run"
    lines = [f"64 B round trip, microseconds, each run's median; {span}:", ""]
    lines += tables.header(["method", "quiet", "one core busy"])
    for label, _, _ in CONTENTION_ROWS:
        cells = [_cell([r[label] for r in per[k]], 1e6, 1) for k in ("quiet", "busy")]
        lines.append(tables.row([label, *cells]))
    zmq = CONTENTION_ROWS[-1][0]
    lines += ["", "Against pyzmq (median of the runs' ratios; each run's ratio in order):"]
    for label, _, _ in CONTENTION_ROWS[:-1]:
        for k, what in (("quiet", "quiet"), ("busy", "one core busy")):
            ratios = [r[label] / r[zmq] for r in per[k]]
            each = ", ".join(f"{x:.2f}" for x in ratios)
            target = " (target <= 0.6)" if k == "busy" and label == CONTENTION_ROWS[0][0] else ""
            lines.append(
                f"- {label} / pyzmq, {what}: {statistics.median(ratios):.2f}x{target} [{each}]"
            )
    lines += [
        "",
        "The client's waits for the acknowledgement, all runs (Ring.wait_counts): % that got it "
        "while spinning (of all: right after a yield that ran the server on the same core), % "
        "that slept (of all: at once, the core found contended):",
        "",
        *tables.header(["method", "quiet", "one core busy"]),
    ]
    for label, _, _ in CONTENTION_ROWS[:-1]:
        cells = []
        for k in ("quiet", "busy"):
            c = waits[k][label]
            n = max(1, sum(c[x] for x in ("spun", "slept")))
            cells.append(
                f"spun {100 * c['spun'] / n:.0f}% ({100 * c['handed_over'] / n:.0f}%), "
                f"slept {100 * c['slept'] / n:.0f}% ({100 * c['slept_at_once'] / n:.0f}%)"
            )
        lines.append(tables.row([label, *cells]))
    return "\n".join(lines)


def _cell(values: list[float], scale: float, digits: int) -> str:
    med = statistics.median(values) * scale
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})"


def _spin_label(name: str, spin: float | None) -> str:
    if spin is None:
        return name
    if spin == DEFAULT_SPIN_US:
        return f"{name} (default: adaptive spin {spin:g} us)"
    return f"{name} (spin {spin:g} us)" if spin else f"{name} (no spin)"


def _tables(
    per_run: list[dict[str, dict]], busy_runs: list[dict[str, dict]], sizes: list[int], runs: int
) -> str:
    def values(runs_: list[dict[str, dict]], name: str, key: tuple) -> list[float]:
        return [r[name][key] for r in runs_ if key in r[name]]

    def med(runs_: list[dict[str, dict]], name: str, key: tuple) -> float:
        return statistics.median(values(runs_, name, key))

    rtt_sizes = [s for s in sizes if s <= RTT_MAX]
    gb_sizes = [s for s in sizes if s >= RTT_MAX]
    names = list(per_run[0])
    span = f"median of {runs} runs (range)" if runs > 1 else "one run"
    lines = [f"Round trip (payload one way, 8 B back), microseconds, each run's median; {span}:"]
    lines += ["", *tables.header(["method", *map(_label, rtt_sizes)])]
    for name in names:
        spins = sorted({k[2] for k in per_run[0][name] if k[0] == "rtt"}, key=lambda v: -(v or 0))
        for spin in spins:
            cells = [_cell(values(per_run, name, ("rtt", s, spin)), 1e6, 1) for s in rtt_sizes]
            lines.append(tables.row([_spin_label(name, spin), *cells]))
    lines += ["", f"One-way throughput, GB/s (10^9 bytes/s); {span}:", ""]
    lines += tables.header(["method", *map(_label, gb_sizes)])
    for name in names:
        label = "ring, reader reads in place" if name == "ring" else name
        cells = [_cell(values(per_run, name, ("gbps", s, None)), 1e-9, 2) for s in gb_sizes]
        lines.append(tables.row([label, *cells]))
    busy_rtt = ("rtt", 64, None)
    lines += ["", f"64 B round trip with one core kept busy, microseconds; {span}:", ""]
    lines += tables.header(["method", "64 B"])
    for spin in RING_SPINS:
        cell = _cell(values(busy_runs, "ring", ("rtt", 64, spin)), 1e6, 1)
        lines.append(tables.row([_spin_label("ring", spin), cell]))
    pyzmq = _cell(values(busy_runs, "pyzmq ipc copy", busy_rtt), 1e6, 1)
    lines.append(tables.row(["pyzmq ipc copy", pyzmq]))

    lines += ["", "Targets (medians of the runs; the peer measured in the same runs):"]
    zmq, seg, floor = "pyzmq ipc copy", "shm segment per message", "memcpy floor (in-process)"
    if 64 in rtt_sizes:
        quiet = med(per_run, "ring", ("rtt", 64, DEFAULT_SPIN_US)) / med(per_run, zmq, busy_rtt)
        lines.append(
            f"- 64 B round trip, ring at defaults / pyzmq, quiet: {quiet:.2f}x (target <= 0.3)"
        )
    busy = med(busy_runs, "ring", ("rtt", 64, DEFAULT_SPIN_US)) / med(busy_runs, zmq, busy_rtt)
    lines.append(
        f"- 64 B round trip, ring at defaults / pyzmq, one core busy: {busy:.2f}x (target <= 0.6)"
    )
    if gb_sizes:
        big = max(gb_sizes)
        for name, label in (("ring", "reads in place"), ("ring, reader copies out", "copies out")):
            ratio = med(per_run, name, ("gbps", big, None)) / med(
                per_run, floor, ("gbps", big, None)
            )
            target = " (target >= 0.8)" if name == "ring" else ""
            lines.append(
                f"- {_label(big)} one way, ring (reader {label}) / memcpy: {ratio:.2f}x{target}"
            )
    for s in [x for x in gb_sizes if x >= 1 << 20]:
        ratio = med(per_run, "ring", ("gbps", s, None)) / med(per_run, seg, ("gbps", s, None))
        target = " (target >= 10)" if s == 1 << 20 else ""
        lines.append(f"- {_label(s)} one way, ring / segment per message: {ratio:.1f}x{target}")
    return "\n".join(lines)


# ---- CUDA: a 64 MiB tensor crossing processes ----

CUDA_BYTES = 64 << 20


def _cuda_ours_server(tag: str, n: int, spin_us: float, ctl: Any) -> None:
    import struct

    from omni_transport import CudaReceiver, Ring, TensorRecord

    rx = CudaReceiver()
    data = Ring.attach(f"omni-bench-{tag}-cd", role="consumer", spin_us=spin_us)
    back = Ring.attach(f"omni-bench-{tag}-ca", role="producer")
    ctl.send("ready")
    for _ in range(n):
        with data.pop() as rec:
            trec = TensorRecord.from_bytes(rec.header)
        tensor = rx.open(trec)  # usable: work queued now sees the producer's writes
        have = time.perf_counter()
        del tensor
        rx.release(trec)
        back.push(struct.pack("<d", have))
    rx.close()
    data.close()
    back.close()


def _cuda_torch_server(q: Any, back: Any, n: int) -> None:
    import torch

    torch.cuda.init()
    for _ in range(n):
        tensor = q.get()
        back.put(time.perf_counter())
        del tensor


def _cuda_ours(n: int, spin_us: float) -> list[float]:
    import struct

    import torch

    from omni_transport import CudaPool, Ring

    tag = uuid.uuid4().hex[:8]
    pool = CudaPool(f"omni-bench-{tag}-pool", 2 * CUDA_BYTES)
    data = Ring.create(f"omni-bench-{tag}-cd", 1 << 20, role="producer")
    back = Ring.create(f"omni-bench-{tag}-ca", 1 << 20, role="consumer")
    ctx = mp.get_context("spawn")
    ctl, ctl_child = ctx.Pipe()
    proc = ctx.Process(target=_cuda_ours_server, args=(tag, n, spin_us, ctl_child), daemon=True)
    proc.start()
    times = []
    try:
        if not ctl.poll(120):
            raise RuntimeError("CUDA benchmark consumer did not start")
        ctl.recv()
        for _ in range(n):
            tensor = pool.empty((CUDA_BYTES // 4,), torch.float32)
            tensor.fill_(1.0)
            torch.cuda.current_stream().synchronize()  # the fill is not part of the crossing
            t0 = time.perf_counter()
            data.push(pool.export(tensor).to_bytes())
            with back.pop(timeout=60) as rec:
                times.append(struct.unpack("<d", bytes(rec.header))[0] - t0)
            del tensor
            pool.reap()
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        data.close()
        back.close()
        pool.close()
    return times


def _cuda_torch(n: int, _spin_us: float) -> list[float]:  # no ring: spin unused
    import torch
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_cuda_torch_server, args=(q, back, n), daemon=True)
    proc.start()
    tensor = torch.ones(CUDA_BYTES // 4, device="cuda")
    torch.cuda.synchronize()
    times = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            q.put(tensor)
            times.append(back.get(timeout=120) - t0)
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return times


def run_cuda(iterations: int, progress: Callable[[str], None]) -> str:
    import torch

    name = torch.cuda.get_device_name()
    warm = max(5, iterations // 10)
    rows = []
    for label, fn, spin in (
        ("omni_transport CUDA IPC, consumer ring at default spin (sleeps)", _cuda_ours, 20.0),
        ("omni_transport CUDA IPC, consumer awake (spin 2 ms)", _cuda_ours, 2000.0),
        ("torch.multiprocessing Queue (its own CUDA IPC sharing)", _cuda_torch, 0.0),
    ):
        progress(f"measuring {label} ...")
        times = fn(iterations + warm, spin)[warm:]
        us = [percentile(times, 50), percentile(times, 90), min(times)]
        rows.append(tables.row([label, *(f"{t * 1e6:.1f}" for t in us)]))
    return "\n".join(
        [
            f"A {CUDA_BYTES >> 20} MiB float32 CUDA tensor crossing to another process on one "
            f"{name}, after {warm} warm-up crossings, {iterations} measured: from the "
            "producer's send to the consumer holding a usable tensor (same-host monotonic "
            "clock), microseconds:",
            "",
            *tables.header(["method", "median", "p90", "min"]),
            *rows,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="omni-bench transport",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    ap.add_argument("--runs", type=int, default=3, help="repeat everything; medians and ranges")
    ap.add_argument("--sizes", help="comma-separated payload sizes in bytes")
    ap.add_argument("--markdown", help="also write the tables to this file")
    ap.add_argument("--cuda", action="store_true", help="only the CUDA tensor crossing")
    ap.add_argument(
        "--contention",
        action="store_true",
        help="only the 64 B round trip, quiet and one core busy, the ring's spin with and "
        "without its contention check, against pyzmq",
    )
    ap.add_argument("--cuda-iterations", type=int, default=200, help="measured crossings (CUDA)")
    args = ap.parse_args(argv)

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else SIZES
    except ValueError:
        print(f"omni-bench transport: --sizes {args.sizes!r}: give integers", file=sys.stderr)
        return 2
    header = f"Machine: {machine_line()}\n\n"
    if args.cuda and args.contention:
        print("omni-bench transport: --cuda and --contention: give one", file=sys.stderr)
        return 2
    if args.cuda:
        body = run_cuda(args.cuda_iterations, progress)
    elif args.contention:
        body = run_contention(args.quick, max(1, args.runs), progress)
    else:
        body = run_cpu(sorted(sizes), args.quick, max(1, args.runs), progress)
    text = header + body
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
