"""CPU accounting from /proc: threads and child processes are charged the CPU they burned.

The burners spin on their own CPU clocks (thread_time / process_time), never on wall time, so
the amounts are known whatever else the machine is doing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from omni_bench.proc_cpu import cores, snapshot

CHILD = """
import time
print("ready", flush=True)
input()
start = time.process_time()
while time.process_time() - start < 0.4:
    pass
print("burned", flush=True)
input()
"""


def test_a_busy_thread_is_charged_its_cpu_time():
    burned, release = threading.Event(), threading.Event()
    info: dict = {}

    def burn() -> None:
        info["tid"] = threading.get_native_id()
        start = time.thread_time()
        while time.thread_time() - start < 0.3:
            pass
        burned.set()
        release.wait()

    before = snapshot(os.getpid())
    worker = threading.Thread(target=burn)
    worker.start()
    try:
        assert burned.wait(60)
        after = snapshot(os.getpid())
    finally:
        release.set()
        worker.join()
    [(name, used)] = [(k[1], v) for k, v in after.threads.items() if k[0] == info["tid"]]
    assert name.startswith("main/")
    assert 0.28 <= used <= 0.45  # 0.3 s burned, counted in 10 ms clock ticks
    got = cores(before, after, wall=2.0)
    assert got["processes"]["main"] >= 0.14  # 0.3 s of CPU over 2 s: at least 0.15 cores


@pytest.mark.timeout(60)
def test_child_processes_are_included_and_labelled():
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"  # start-up CPU is spent by now
        before = snapshot(os.getpid())
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "burned"
        after = snapshot(os.getpid())
    finally:
        child.communicate("\n", timeout=10)
    got = cores(before, after, wall=1.0)
    mine = {k: v for k, v in got["threads"].items() if k.endswith(f":{child.pid}")}
    [(name, used)] = mine.items()
    assert name.startswith("python")  # labelled by its executable (no -m module here)
    assert 0.38 <= used <= 0.5  # 0.4 s burned between the snapshots, in 10 ms ticks
    assert 0.38 <= got["processes"][name.split("/")[0]] <= 0.5


def test_a_process_keeps_the_time_of_its_exited_threads():
    def burn() -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.2:
            pass

    before = snapshot(os.getpid())
    worker = threading.Thread(target=burn)
    worker.start()
    worker.join()  # gone from /proc/<pid>/task, still in the process's total
    got = cores(before, snapshot(os.getpid()), wall=1.0)
    assert got["processes"]["main"] >= 0.18
