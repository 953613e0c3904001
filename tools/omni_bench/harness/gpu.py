"""The GPU's memory in use as nvidia-smi reports it (every process on the device, the CUDA
contexts and MPS included, which no process's own allocator sees): a reading now, and the peak
of a run sampled in a thread. Without nvidia-smi (a CPU machine) every reading is 0."""

from __future__ import annotations

import shutil
import subprocess
import threading

SAMPLE_S = 0.5


class GpuMemory:
    """The first GPU's memory in use (MiB, nvidia-smi), sampled every SAMPLE_S while entered:
    `peak` is the largest reading."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def now() -> int:
        if shutil.which("nvidia-smi") is None:
            return 0
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()
        return int(out[0]) if out else 0

    def __enter__(self) -> GpuMemory:
        def sample() -> None:
            while not self._stop.wait(SAMPLE_S):
                self.peak = max(self.peak, self.now())

        self.peak = self.now()
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
