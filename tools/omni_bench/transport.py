"""Transport benchmark: the shared-memory ring against the usual ways to move bytes between two
processes on one host, and (with --cuda) a CUDA tensor crossing processes.

    python -m omni_bench.transport [--quick] [--markdown FILE] [--cuda]

For each payload size it measures, between two processes:
- round trip: the payload one way, an 8-byte acknowledgement back (median of many);
- one-way GB/s: a burst of payloads, the receiver acknowledges the last one.
Methods: the ring (zero-copy read; round trip with the spin before sleeping on and off),
pyzmq PAIR over ipc:// (copying and zero-copy), a new multiprocessing.shared_memory segment per
message (what the reference system does: create, copy in, send the name, open, copy out,
unlink), multiprocessing.Queue with a pickled numpy array, and the floor: one in-process
memcpy (np.copyto) of the same size.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

SIZES = [64, 4 << 10, 64 << 10, 1 << 20, 16 << 20]
RTT_MAX = 64 << 10  # round trips are measured up to this size; GB/s from 64 KiB up
RING_SPIN_US = 50.0
WARM_BYTES = 64 << 20  # the ring's capacity in this benchmark


def _label(size: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size >> shift} {unit}"
    return f"{size} B"


# ---- the methods: a client (this process) and a server (the other process) ----


class Method:
    """One way to move a payload. The server half runs in a spawned process."""

    name = ""

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
    name = "ring"

    def __init__(self, tag: str, spin_us: float = RING_SPIN_US):
        super().__init__(tag)
        self.spin_us = spin_us

    def client_open(self) -> None:
        from omni_transport import Ring

        self.data = Ring.create(f"omni-bench-{self.tag}-d", 64 << 20, role="producer")
        self.back = Ring.create(f"omni-bench-{self.tag}-a", 1 << 20, role="consumer")
        self.set_spin(self.spin_us)

    def server_open(self) -> None:
        from omni_transport import Ring

        self.data = Ring.attach(f"omni-bench-{self.tag}-d", role="consumer")
        self.back = Ring.attach(f"omni-bench-{self.tag}-a", role="producer")
        self.set_spin(self.spin_us)

    def set_spin(self, spin_us: float) -> None:
        self.data.spin_us = self.back.spin_us = spin_us

    def send(self, payload: np.ndarray) -> None:
        self.data.push(b"", (payload,))

    def recv(self) -> None:
        rec = self.data.pop()  # zero-copy: the views are the consumer's data
        rec.release()

    def ack(self) -> None:
        self.back.push(b"ack12345")

    def wait_ack(self) -> None:
        self.back.pop().release()

    def close(self) -> None:
        self.data.close()
        self.back.close()


class ZmqMethod(Method):
    def __init__(self, tag: str, copy: bool):
        super().__init__(tag)
        self.copy = copy
        self.name = "pyzmq ipc copy" if copy else "pyzmq ipc zero-copy"
        self.addr = f"ipc://{tempfile.gettempdir()}/omni-bench-{tag}.sock"

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
        self.sock.send(payload, copy=self.copy)

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
        np.frombuffer(shm.buf, np.uint8)[:] = payload
        # the receiver unlinks it: keep this process's resource tracker out of it
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        self.sock.send_string(shm.name)
        shm.close()

    def recv(self) -> None:
        shm = shared_memory.SharedMemory(name=self.sock.recv_string())
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
            if size <= RTT_MAX:
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


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = os.getloadavg()[0]
    return (
        f"{cpu}, {os.cpu_count()} cores, Linux {platform.release()}, Python "
        f"{platform.python_version()}, load average {load:.1f} at start"
    )


def run_cpu(sizes: list[int], quick: bool, progress: Callable[[str], None]) -> str:
    tag = uuid.uuid4().hex[:8]
    spins = [RING_SPIN_US, 0.0]
    rows: dict[str, dict] = {}
    plan: list[tuple[str, Method, list]] = [
        ("ring", RingMethod(tag + "r"), spins),
        ("pyzmq ipc copy", ZmqMethod(tag + "zc", copy=True), [None]),
        ("pyzmq ipc zero-copy", ZmqMethod(tag + "zz", copy=False), [None]),
        ("shm segment per message", SegmentPerMessage(tag + "s"), [None]),
        ("multiprocessing.Queue", QueueMethod(tag + "q"), [None]),
    ]
    for name, method, method_spins in plan:
        progress(f"measuring {name} ...")
        rows[name] = _measure(method, sizes, quick, method_spins)
    rows["memcpy floor (in-process)"] = _memcpy_floor(sizes, quick)
    return _table(rows, sizes, spins)


def _table(rows: dict[str, dict], sizes: list[int], spins: list[float]) -> str:
    rtt_sizes = [s for s in sizes if s <= RTT_MAX]
    gb_sizes = [s for s in sizes if s >= RTT_MAX]
    lines = ["Round trip (payload one way, 8 B back), median, microseconds:", ""]
    lines.append("| method | " + " | ".join(_label(s) for s in rtt_sizes) + " |")
    lines.append("|---" * (len(rtt_sizes) + 1) + "|")
    for name, res in rows.items():
        keys = [k for k in res if k[0] == "rtt"]
        for spin in sorted({k[2] for k in keys}, key=lambda v: -(v or 0)):
            label = name
            if spin is not None:
                label += f" (spin {spin:g} us)" if spin else " (no spin)"
            cells = [f"{res[('rtt', s, spin)] * 1e6:.1f}" for s in rtt_sizes]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "One-way throughput, GB/s (10^9 bytes/s):", ""]
    lines.append("| method | " + " | ".join(_label(s) for s in gb_sizes) + " |")
    lines.append("|---" * (len(gb_sizes) + 1) + "|")
    for name, res in rows.items():
        cells = [f"{res[('gbps', s, None)] / 1e9:.2f}" for s in gb_sizes]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    ring, seg, floor = (
        rows["ring"],
        rows["shm segment per message"],
        rows["memcpy floor (in-process)"],
    )
    zmq = rows["pyzmq ipc copy"]
    lines += ["", "Targets (same run):"]
    if gb_sizes:
        big = max(gb_sizes)
        lines.append(
            f"- ring GB/s at {_label(big)} vs memcpy floor: "
            f"{ring[('gbps', big, None)] / floor[('gbps', big, None)]:.2f}x (target >= 0.5)"
        )
    for s in [x for x in gb_sizes if x >= 1 << 20]:
        lines.append(
            f"- ring vs segment per message at {_label(s)}: "
            f"{ring[('gbps', s, None)] / seg[('gbps', s, None)]:.1f}x (target >= 5)"
        )
    if rtt_sizes:
        small = min(rtt_sizes)
        for spin in spins:
            mode = f"spin {spin:g} us" if spin else "no spin"
            lines.append(
                f"- ring round trip at {_label(small)} ({mode}) / pyzmq: "
                f"{ring[('rtt', small, spin)] / zmq[('rtt', small, None)]:.3f} (target <= 0.125)"
            )
    return "\n".join(lines)


# ---- CUDA: a 64 MiB tensor crossing processes ----

CUDA_BYTES = 64 << 20


def _cuda_ours_server(tag: str, n: int, spin_us: float, ctl: Any) -> None:
    import struct

    from omni_transport import Ring
    from omni_transport.cuda_ipc import CudaReceiver, TensorRecord

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

    from omni_transport import Ring
    from omni_transport.cuda_ipc import CudaPool

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
        rows.append(
            f"| {label} | {statistics.median(times) * 1e6:.1f} | "
            f"{np.percentile(times, 90) * 1e6:.1f} | {min(times) * 1e6:.1f} |"
        )
    return "\n".join(
        [
            f"A {CUDA_BYTES >> 20} MiB float32 CUDA tensor crossing to another process on one "
            f"{name}, after {warm} warm-up crossings, {iterations} measured: from the "
            "producer's send to the consumer holding a usable tensor (same-host monotonic "
            "clock), microseconds:",
            "",
            "| method | median | p90 | min |",
            "|---|---|---|---|",
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
    ap.add_argument("--sizes", help="comma-separated payload sizes in bytes")
    ap.add_argument("--markdown", help="also write the tables to this file")
    ap.add_argument("--cuda", action="store_true", help="only the CUDA tensor crossing")
    ap.add_argument("--cuda-iterations", type=int, default=200, help="measured crossings (CUDA)")
    args = ap.parse_args(argv)

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else SIZES
    except ValueError:
        print(f"omni-bench transport: --sizes {args.sizes!r}: give integers", file=sys.stderr)
        return 2
    header = f"Machine: {_machine()}\n\n"
    body = (
        run_cuda(args.cuda_iterations, progress)
        if args.cuda
        else run_cpu(sorted(sizes), args.quick, progress)
    )
    text = header + body
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
