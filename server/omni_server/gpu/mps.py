"""CUDA MPS for the stage processes of one run: which processes, one private daemon, cleanup.

Who runs under MPS (`clients`), after the reference design: a stage process is eligible when it
is not a TP rank and all its GPU stages are on one GPU. `auto` takes the eligible processes of
every GPU that hosts two or more of them; `on` takes every eligible process.

One control daemon per run, private to it: its pipe and log directories are
`RUN_DIR/mps/{pipe,log}` (mode 0700), so no other user or server can reach it, and it is started
with CUDA_VISIBLE_DEVICES = the UUIDs of the server's GPUs 0..k (k: the highest GPU a client
uses), in the server's order; its clients get the same UUID list. Why one daemon and not one
per GPU: an MPS client sees only the GPUs of its daemon, renumbered in the daemon's order.
With per-GPU daemons a client on physical GPU 1 would see it as cuda:0, and every
device index in the plan, the CUDA IPC records and the tensors' pickled devices would need
translating per process. With one daemon over GPUs 0..k in the server's order, `cuda:N` means
the same GPU in every process, client or not. The MPS server it spawns schedules each GPU
separately; what MPS shares is per GPU either way.

A daemon outlives a SIGKILLed server (it detaches). The next start finds it through the pid
file in the dead run directory's pipe directory and stops it, but only when the process is
ours: same user, and its environment names that very pipe directory (a reused pid does not).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from omni_server.compiler.plan import MpsMode, Plan

from .devices import MPS_CONTROL, Gpu, Machine

log = logging.getLogger(__name__)

PID_FILE = "nvidia-cuda-mps-control.pid"  # the daemon writes it into its pipe directory
_COMMAND_TIMEOUT_S = 10.0  # one control command (start, quit)
_PID_FILE_WAIT_S = 5.0  # the daemon has detached: its pid file follows shortly
_PROBE_TIMEOUT_S = 30.0  # a CUDA client's first context (the MPS server starts for it)
_EXIT_WAIT_S = 5.0  # after quit / SIGTERM, before SIGKILL
_MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes; the daemon's sockets live in the pipe dir


# A CUDA client in a few driver calls (no torch: it starts in milliseconds). Primary context
# retain/release: the driver API every CUDA version keeps. Exits non-zero naming the error.
CLIENT_PROBE = """
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
def check(rc, call):
    if rc:
        name = ctypes.c_char_p()
        cuda.cuGetErrorName(rc, ctypes.byref(name))
        sys.exit(f"{call}: {(name.value or b'error %d' % rc).decode()}")
check(cuda.cuInit(0), "cuInit")
device, ctx = ctypes.c_int(), ctypes.c_void_p()
check(cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
check(cuda.cuDevicePrimaryCtxRelease_v2(device), "cuDevicePrimaryCtxRelease")
"""


class MpsUnavailable(Exception):
    """MPS cannot start here; the message says why in one line."""


def clients(plan: Plan, mode: MpsMode) -> dict[int, int]:
    """Instance index -> the one GPU it uses, for the instances that run under MPS."""
    if mode is MpsMode.OFF:
        return {}
    eligible: dict[int, int] = {}
    for index, instance in enumerate(plan.instances):
        devices = {d for d in instance.devices.values() if d is not None}
        if instance.tp_size == 1 and len(devices) == 1:
            eligible[index] = devices.pop()
    if mode is MpsMode.ON:
        return eligible
    per_gpu: dict[int, int] = {}
    for gpu in eligible.values():
        per_gpu[gpu] = per_gpu.get(gpu, 0) + 1
    return {i: gpu for i, gpu in eligible.items() if per_gpu[gpu] >= 2}


class MpsDaemon:
    """One MPS control daemon under `run_dir/mps`, for the server's GPUs `gpus` (0..k)."""

    def __init__(self, run_dir: Path, gpus: tuple[Gpu, ...], control: str) -> None:
        self.root = run_dir / "mps"
        self.pipe_dir = self.root / "pipe"
        self.log_dir = self.root / "log"
        self.gpus = gpus
        self._control = control
        self.pid: int | None = None

    def _env(self, base: Mapping[str, str]) -> dict[str, str]:
        return {
            **base,
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
        }

    def visible_devices(self) -> str:
        return ",".join(g.uuid for g in self.gpus)

    def client_env(self, base: Mapping[str, str]) -> dict[str, str]:
        """A stage process's environment under this daemon: its directories, and the daemon's
        own CUDA_VISIBLE_DEVICES (UUIDs). A client's list is read against the daemon's
        remapped GPUs; UUIDs name the same GPUs there, so CUDA sees what it would see with no
        list at all. Without a list, tools that count GPUs through NVML (torch does) would
        count every GPU of the machine while CUDA sees the daemon's: a mismatch torch fails on
        where the daemon does not cover them all."""
        env = self._env(base)
        env["CUDA_VISIBLE_DEVICES"] = self.visible_devices()
        return env

    def start(self) -> None:
        """Start the daemon (blocking, bounded); MpsUnavailable says why it cannot."""
        if len(str(self.pipe_dir / "control")) > _MAX_SOCKET_PATH:
            raise MpsUnavailable(f"the MPS pipe directory path is too long: {self.pipe_dir}")
        for path in (self.root, self.pipe_dir, self.log_dir):
            path.mkdir(mode=0o700)
        env = self._env(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = self.visible_devices()
        self._daemonize(env)
        self.pid = self._wait_pid_file()
        probe = self._command([], "get_server_list\n", env)
        if probe.returncode != 0:
            raise MpsUnavailable(f"the MPS control daemon does not answer: {_last_line(probe)}")
        self._probe_client()
        gpus = ", ".join(f"cuda:{g.index}" for g in self.gpus)
        log.info("MPS control daemon (pid %d) for %s at %s", self.pid, gpus, self.pipe_dir)

    def _probe_client(self) -> None:
        """Open a CUDA context as a client, so that the daemon starts its MPS server now:
        where MPS cannot run (the platform, a container, the compute mode) the run learns it
        here, not from a stage's CUDA error later."""
        try:
            out = subprocess.run(
                [sys.executable, "-c", CLIENT_PROBE],
                env=self.client_env(os.environ),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=_PROBE_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise MpsUnavailable("a CUDA client of the MPS daemon did not start in time") from exc
        if out.returncode != 0:
            raise MpsUnavailable(f"a CUDA client of the MPS daemon failed: {_last_line(out)}")

    def _daemonize(self, env: Mapping[str, str]) -> None:
        # its output goes to a file, not a pipe: the detached daemon may keep the pipe open
        out_path = self.root / "start.out"
        with open(out_path, "w+") as out:
            try:
                code = subprocess.run(
                    [self._control, "-d"],
                    env=dict(env),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    timeout=_COMMAND_TIMEOUT_S,
                    check=False,
                ).returncode
            except subprocess.TimeoutExpired as exc:
                raise MpsUnavailable(f"{MPS_CONTROL} -d did not return") from exc
            except OSError as exc:
                raise MpsUnavailable(f"{MPS_CONTROL} cannot run: {exc}") from exc
            out.seek(0)
            lines = out.read().strip().splitlines()
        out_path.unlink()
        if code != 0:
            why = lines[-1] if lines else f"exit code {code}"
            raise MpsUnavailable(f"{MPS_CONTROL} -d failed: {why}")

    def _command(
        self, args: list[str], stdin: str | None, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [self._control, *args],
                input=stdin,
                env=dict(env or self._env(os.environ)),
                capture_output=True,
                text=True,
                timeout=_COMMAND_TIMEOUT_S,
                check=False,
                stdin=None if stdin is not None else subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise MpsUnavailable(f"{MPS_CONTROL} {' '.join(args)} did not return") from exc
        except OSError as exc:
            raise MpsUnavailable(f"{MPS_CONTROL} cannot run: {exc}") from exc

    def _wait_pid_file(self) -> int:
        deadline = time.monotonic() + _PID_FILE_WAIT_S
        while True:  # the daemon detached from us: no exit or fd to wait on, only its file
            pid = _read_pid(self.pipe_dir)
            if pid is not None and _pipe_dir_of(pid) == str(self.pipe_dir):
                return pid
            # a daemon that writes no pid file, found by its environment
            found = processes_of(self.pipe_dir)
            if len(found) == 1:
                return found[0]
            if time.monotonic() > deadline:
                raise MpsUnavailable(f"the MPS control daemon wrote no pid file in {self.pipe_dir}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Quit the daemon (its MPS server goes with it), kill what is left of ours, remove
        the pipe and log directories. Call after the client processes have exited."""
        if self.pid is not None and _pipe_dir_of(self.pid) == str(self.pipe_dir):
            with contextlib.suppress(MpsUnavailable):
                self._command([], "quit\n")
            wait_exit(self.pid, _EXIT_WAIT_S)
        _kill(processes_of(self.pipe_dir))
        self.pid = None
        shutil.rmtree(self.root, ignore_errors=True)


def start(plan: Plan, machine: Machine, run_dir: Path) -> tuple[MpsDaemon | None, dict[int, int]]:
    """The run's daemon and its clients (instance -> GPU), or (None, {}) where MPS is off,
    has no clients, or (mode auto) cannot start: one warning line then. Mode on where it
    cannot start raises MpsUnavailable with the line for the operator."""
    mode = plan.server.mps
    remove_stale(run_dir)  # a run directory reused after a crash
    chosen = clients(plan, mode)
    if not chosen:
        if mode is not MpsMode.OFF:
            log.info("mps = %s: no GPU is shared by stage processes that MPS can serve", mode)
        return None, {}
    used = sorted(set(chosen.values()))
    try:
        if machine.mps_control is None:
            raise MpsUnavailable(f"{MPS_CONTROL} not found")
        daemon = MpsDaemon(run_dir, machine.gpus[: used[-1] + 1], machine.mps_control)
        try:
            daemon.start()
        except MpsUnavailable:
            daemon.stop()
            raise
    except MpsUnavailable as exc:
        where = ", ".join(f"cuda:{g}" for g in used)
        if mode is MpsMode.ON:
            raise MpsUnavailable(f"mps = on, but MPS cannot start on {where}: {exc}") from exc
        log.warning("mps = auto: MPS cannot start (%s); %s shared without MPS", exc, where)
        return None, {}
    return daemon, chosen


def remove_stale(run_dir: Path) -> list[int]:
    """Stop the MPS daemon (and server) of a dead run in `run_dir`, if any of ours still runs,
    and remove its directories. Returns the pids it stopped."""
    pipe_dir = run_dir / "mps" / "pipe"
    if not pipe_dir.is_dir():
        return []
    pids = processes_of(pipe_dir)
    if pids:
        control = shutil.which(MPS_CONTROL)
        daemon = _read_pid(pipe_dir)
        if control is not None and daemon in pids:
            stale = MpsDaemon(run_dir, (), control)
            with contextlib.suppress(MpsUnavailable):
                stale._command([], "quit\n")
            wait_exit(daemon, _EXIT_WAIT_S)
        _kill(processes_of(pipe_dir))
        log.warning("stopped the MPS daemon of a dead run in %s (pids %s)", run_dir, pids)
    shutil.rmtree(run_dir / "mps", ignore_errors=True)
    return pids


# ---- processes of ours ---------------------------------------------------------------------


def processes_of(pipe_dir: Path) -> list[int]:
    """Live processes of this user that serve `pipe_dir`: the pid file's process, and any MPS
    program (control daemon, server) whose environment names that pipe directory. Public for
    the leak checks of the tests: after a stop this must be empty."""
    want = str(pipe_dir)
    found = set()
    pid = _read_pid(pipe_dir)
    if pid is not None and _pipe_dir_of(pid) == want:
        found.add(pid)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            comm = Path(f"/proc/{entry}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith("nvidia-cuda-mps") and _pipe_dir_of(int(entry)) == want:
            found.add(int(entry))
    return sorted(found)


def _pipe_dir_of(pid: int) -> str | None:
    """CUDA_MPS_PIPE_DIRECTORY in process `pid`'s environment, if it is ours and readable."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return None
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for item in environ.split(b"\0"):
        if item.startswith(b"CUDA_MPS_PIPE_DIRECTORY="):
            return item.split(b"=", 1)[1].decode(errors="replace")
    return None


def _read_pid(pipe_dir: Path) -> int | None:
    try:
        text = (pipe_dir / PID_FILE).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def wait_exit(pid: int, timeout: float) -> bool:
    """Wait (bounded) for process `pid`, not necessarily our child, to exit; True if it did
    (public for the tests, which watch a daemon that is not their child go)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(timeout * 1000))
    finally:
        os.close(fd)


def _kill(pids: list[int]) -> None:
    """SIGTERM, a grace period, SIGKILL (each pid was checked to be ours just before)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                left.append(pid)
        for pid in left:
            wait_exit(pid, _EXIT_WAIT_S if sig == signal.SIGTERM else 1.0)
        pids = [p for p in left if not wait_exit(p, 0)]


def _last_line(out: subprocess.CompletedProcess[str]) -> str:
    lines = (out.stderr or out.stdout or "").strip().splitlines()
    return lines[-1] if lines else f"exit code {out.returncode}"
