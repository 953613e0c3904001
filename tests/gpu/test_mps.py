"""CUDA MPS managed by the runtime: started for the stage processes that share a GPU, stopped
with the runtime, cleaned up after a SIGKILLed server; `on` that cannot start is one line,
`auto` one warning.

Without a GPU the MPS control program is `tests/fixtures/fake_mps_control.py` (the real one
needs the NVIDIA driver): a detached daemon with the real one's pid file, socket and commands,
so the runtime's start, stop and stale-daemon cleanup really run. The `gpu` tests use the
real daemon and ask it which processes it serves.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.plan import Plan
from omni_server.errors import PipelineError
from omni_server.gpu import mps
from omni_server.gpu.devices import MPS_CONTROL, Machine, discover
from omni_server.gpu.mps import PID_FILE, processes_of
from omni_server.pipeline import Runtime
from omni_server.pipeline.run_dirs import OWNER_FILE, RUN_DIR_PREFIX
from omni_server.pipeline.supervision import SupervisionPolicy
from tests.fixtures import FIXTURES
from tests.gpu.test_gpu_start import fake_machine, gpu_repo
from tests.helpers.pipelines import chain
from tests.helpers.proc import alive
from tests.helpers.repo import toml
from tests.helpers.runtime import running
from tests.helpers.server import ROOT

pytestmark = pytest.mark.timeout(120)

FAKE_CONTROL = FIXTURES / "fake_mps_control.py"


# Stands in for the runtime's CUDA client probe (no CUDA here): a client naming its GPUs by
# UUID, as its daemon does, that reaches the daemon of its pipe directory.
FAKE_CLIENT_PROBE = """
import os, socket
assert os.environ["CUDA_VISIBLE_DEVICES"].startswith("GPU-")
client = socket.socket(socket.AF_UNIX)
client.connect(os.environ["CUDA_MPS_PIPE_DIRECTORY"] + "/control")
client.close()
"""


@pytest.fixture
def fake_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An executable `nvidia-cuda-mps-control` that runs the fake (and the fake client probe)."""
    path = tmp_path / "bin" / MPS_CONTROL
    path.parent.mkdir()
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_CONTROL}" "$@"\n')
    path.chmod(0o755)
    monkeypatch.setattr(mps, "CLIENT_PROBE", FAKE_CLIENT_PROBE)
    return str(path)


def two_processes_on_gpu0(root: Path, mps: str, compute: bool = False) -> Plan:
    """a -> b, each in a process of its own on cuda:0."""
    gpu = toml(f"""
        gpu = 0
        gpu_memory_fraction = 0.2
        [parameters]
        compute = {str(compute).lower()}
    """)
    stages = {"a": 'next = "b"\n' + gpu, "b": "terminal = true\n" + gpu}
    return compile_repository(gpu_repo(root, stages, server=f'mps = "{mps}"'))


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    return mps.wait_exit(pid, timeout)


# ---- on / auto where MPS cannot start -----------------------------------------------------------


@pytest.mark.parametrize(
    ("control", "why"),
    [
        (None, "nvidia-cuda-mps-control not found"),
        ("/bin/false", "nvidia-cuda-mps-control -d failed: exit code 1"),
    ],
)
async def test_mps_on_that_cannot_start_fails_with_one_line_and_leaves_nothing(
    tmp_path, control, why
):
    plan = two_processes_on_gpu0(tmp_path, "on")
    runtime = Runtime(plan, machine=fake_machine(1, control))
    with pytest.raises(PipelineError) as failed:
        await runtime.start()
    assert failed.value.message == f"mps = on, but MPS cannot start on cuda:0: {why}"
    assert runtime.processes() == {}  # no stage process was spawned
    run_dir = runtime.run_dir
    await runtime.stop()
    assert run_dir is not None and not run_dir.exists()


def _has_libcuda() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_has_libcuda(), reason="this machine has a CUDA driver")
async def test_mps_on_whose_cuda_client_cannot_start_fails_and_stops_the_daemon(
    tmp_path, fake_control, monkeypatch
):
    monkeypatch.undo()  # the fixture's stand-in probe goes: the runtime's own CUDA client runs
    plan = two_processes_on_gpu0(tmp_path, "on")
    runtime = Runtime(plan, machine=fake_machine(1, fake_control))
    with pytest.raises(PipelineError) as failed:
        await runtime.start()
    assert failed.value.message.startswith(
        "mps = on, but MPS cannot start on cuda:0: a CUDA client of the MPS daemon failed: "
        "OSError: libcuda.so.1"
    )
    run_dir = runtime.run_dir
    assert run_dir is not None
    await runtime.stop()
    assert not run_dir.exists()
    assert processes_of(run_dir / "mps" / "pipe") == []  # the daemon it started is stopped


async def test_mps_auto_that_cannot_start_warns_once_and_serves(tmp_path, caplog):
    plan = two_processes_on_gpu0(tmp_path, "auto")
    with caplog.at_level(logging.WARNING, logger="omni_server.gpu.mps"):
        async with running(plan, machine=fake_machine(1, None)) as runtime:
            out = await runtime.submit(plan.models["m"], {}).result()
    assert out["mps_pipe"] is None
    warnings = [r.getMessage() for r in caplog.records if r.name == "omni_server.gpu.mps"]
    assert warnings == [
        "mps = auto: MPS cannot start (nvidia-cuda-mps-control not found); "
        "cuda:0 shared without MPS"
    ]


# ---- the daemon's life (fake control program) ------------------------------------------------


async def test_mps_daemon_serves_the_gpu_processes_and_goes_with_the_runtime(
    tmp_path, fake_control, monkeypatch, caplog
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # the server's view: clients get UUIDs
    plan = two_processes_on_gpu0(tmp_path, "on")
    with caplog.at_level(logging.INFO, logger="omni_server.gpu.mps"):
        async with running(plan, machine=fake_machine(1, fake_control)) as runtime:
            assert runtime.run_dir is not None
            pipe = runtime.run_dir / "mps" / "pipe"
            daemon = int((pipe / PID_FILE).read_text())
            assert alive(daemon) and _environ(daemon)["CUDA_VISIBLE_DEVICES"] == "GPU-fake-0"
            for path in (pipe.parent, pipe, pipe.parent / "log"):
                assert path.stat().st_mode & 0o777 == 0o700  # private to this user
            out = await runtime.submit(plan.models["m"], {}).result()
            assert out["mps_pipe"] == str(pipe) and out["visible"] == "GPU-fake-0"
            for pid in runtime.processes().values():  # both stage processes are clients
                env = _environ(pid)
                assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
                assert env["CUDA_VISIBLE_DEVICES"] == "GPU-fake-0"  # the daemon's list
    assert _wait_gone(daemon), "the MPS daemon outlived the runtime"
    # running() checked that the run directory, pipe and log directories included, is gone
    assert any(
        f"MPS control daemon (pid {daemon}) for cuda:0" in r.getMessage() for r in caplog.records
    )


async def test_a_restarted_process_is_again_a_client_of_the_same_daemon(tmp_path, fake_control):
    plan = two_processes_on_gpu0(tmp_path, "on")
    policy = SupervisionPolicy(backoff_s=0.1)
    async with running(plan, machine=fake_machine(1, fake_control), supervision=policy) as rt:
        assert rt.run_dir is not None
        pipe = rt.run_dir / "mps" / "pipe"
        daemon = int((pipe / PID_FILE).read_text())
        restarted = asyncio.get_running_loop().create_future()
        rt.supervision_observers.append(
            lambda kind, who, _: (
                kind == "restart" and not restarted.done() and restarted.set_result(who)
            )
        )
        victim = rt.processes()["b@r0"]
        os.kill(victim, signal.SIGKILL)
        assert await asyncio.wait_for(restarted, 60) == "b@r0"
        successor = rt.processes()["b@r0"]
        assert successor != victim
        assert _environ(successor)["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
        assert alive(daemon)  # the daemon serves the whole run, across restarts
        out = await rt.submit(plan.models["m"], {}).result()
        assert out["pid"] == successor and out["mps_pipe"] == str(pipe)
    assert _wait_gone(daemon)


async def test_mps_off_starts_no_daemon(tmp_path, fake_control):
    plan = two_processes_on_gpu0(tmp_path, "off")
    async with running(plan, machine=fake_machine(1, fake_control)) as runtime:
        assert runtime.run_dir is not None and not (runtime.run_dir / "mps").exists()
        out = await runtime.submit(plan.models["m"], {}).result()
        assert out["mps_pipe"] is None


# ---- stale daemons of dead runs ------------------------------------------------------------------


def _dead_run_dir() -> Path:
    run_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))
    (run_dir / OWNER_FILE).write_text("4194303 1")  # above any pid_max: a dead owner
    (run_dir / "mps" / "pipe").mkdir(parents=True, mode=0o700)
    return run_dir


async def test_start_stops_the_daemon_of_a_dead_run_and_spares_a_stranger(tmp_path, fake_control):
    ours = _dead_run_dir()
    pipe = ours / "mps" / "pipe"
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
    subprocess.run([fake_control, "-d"], env=env, check=True, timeout=30)
    for _ in range(200):  # the detached daemon writes its pid file shortly
        if (pipe / PID_FILE).exists():
            break
        await asyncio.sleep(0.05)
    daemon = int((pipe / PID_FILE).read_text())
    # a dead run whose pid file names a process that is not its daemon (a reused pid)
    stranger_dir = _dead_run_dir()
    stranger = subprocess.Popen(["sleep", "300"])
    (stranger_dir / "mps" / "pipe" / PID_FILE).write_text(f"{stranger.pid}\n")
    try:
        async with running(chain(tmp_path, "split")):
            assert not ours.exists() and not stranger_dir.exists()
            assert _wait_gone(daemon), "the dead run's daemon still runs"
            assert stranger.poll() is None, "a process that is not our daemon was killed"
    finally:
        stranger.kill()
        stranger.wait()
        if alive(daemon):
            os.kill(daemon, signal.SIGKILL)


SERVER = """
import asyncio, json, sys
from omni_server.compiler.compiler import compile_repository
from omni_server.pipeline import Runtime
from omni_server.gpu import mps
from omni_server.gpu.devices import Gpu, Machine, discover
import os

async def main():
    plan = compile_repository(sys.argv[1])
    control = sys.argv[2]
    machine = discover(os.environ)
    if control != "real":
        machine = Machine((Gpu(0, "GPU-fake-0"),), mps_control=control)
        mps.CLIENT_PROBE = sys.argv[3]
    runtime = Runtime(plan, machine=machine)
    await runtime.start()
    await runtime.submit(plan.models["m"], {}).result()
    pipe = runtime.run_dir / "mps" / "pipe"
    daemon = int((pipe / "nvidia-cuda-mps-control.pid").read_text())
    pids = list(runtime.processes().values())
    print(json.dumps({"run_dir": str(runtime.run_dir), "pids": pids, "daemon": daemon}), flush=True)
    await asyncio.sleep(300)

asyncio.run(main())
"""


async def _sigkilled_server_is_cleaned_up(tmp_path: Path, control: str, compute: bool) -> None:
    plan = two_processes_on_gpu0(tmp_path / "repo", "on", compute=compute)
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(plan.repository), control, FAKE_CLIENT_PROBE],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert server.stdout is not None
        started = json.loads(server.stdout.readline())
    finally:
        server.kill()
        server.wait()
    run_dir = Path(started["run_dir"])
    for pid in started["pids"]:  # stage processes die with their server
        assert _wait_gone(pid)
    pipe = run_dir / "mps" / "pipe"
    left = processes_of(pipe)
    assert started["daemon"] in left, "the daemon should outlive a SIGKILLed server"
    async with running(chain(tmp_path, "split")):
        assert not run_dir.exists()
        for pid in left:
            assert _wait_gone(pid), f"MPS process {pid} of the dead run still runs"


async def test_a_sigkilled_servers_daemon_is_stopped_by_the_next_start(tmp_path, fake_control):
    await _sigkilled_server_is_cleaned_up(tmp_path, fake_control, compute=False)


# ---- on the GPU: the real daemon ----------------------------------------------------------------


def _control(pipe: Path, command: str) -> str:
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
    done = subprocess.run(
        [MPS_CONTROL], input=command + "\n", env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.gpu
async def test_two_gpu_processes_run_under_the_real_mps_daemon(tmp_path):
    machine: Machine = discover(os.environ)
    if machine.mps_control is None:
        pytest.skip("nvidia-cuda-mps-control is not installed here")
    plan = two_processes_on_gpu0(tmp_path, "on", compute=True)
    async with running(plan, machine=machine) as runtime:
        assert runtime.run_dir is not None
        pipe = runtime.run_dir / "mps" / "pipe"
        daemon = int((pipe / PID_FILE).read_text())
        outs = await asyncio.gather(
            *(runtime.submit(plan.models["m"], {}).result() for _ in range(8))
        )
        assert all(o["sum"] == pytest.approx(512.0, rel=1e-3) for o in outs)
        assert all(o["mps_pipe"] == str(pipe) for o in outs)
        servers = _control(pipe, "get_server_list").split()
        assert len(servers) == 1, servers
        clients = {int(p) for p in _control(pipe, f"get_client_list {servers[0]}").split()}
        stage_pids = set(runtime.processes().values())
        assert stage_pids <= clients, (stage_pids, clients)
        mps_pids = processes_of(pipe)
    assert _wait_gone(daemon)
    for pid in mps_pids:  # the MPS server went with its daemon
        assert _wait_gone(pid)


@pytest.mark.gpu
async def test_a_sigkilled_servers_real_daemon_is_stopped_by_the_next_start(tmp_path):
    if discover(os.environ).mps_control is None:
        pytest.skip("nvidia-cuda-mps-control is not installed here")
    await _sigkilled_server_is_cleaned_up(tmp_path, "real", compute=True)


@pytest.mark.slow  # three runtimes in a row
def test_the_gpu_mps_benchmark_runs_end_to_end_on_the_cpu():
    code = "import sys; from omni_bench.cli import main; sys.exit(main(sys.argv[1:]))"
    args = ["gpu-mps", "--cpu", "--requests", "4", "--warmup", "1", "--size", "32", "--layers", "1"]
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")][1:]
    assert [r.split("|")[1].strip() for r in rows] == [
        "one process alone",
        "two processes, MPS off",
        "two processes, MPS on",
    ]
    for row in rows:
        assert float(row.split("|")[2]) > 0  # requests/s measured
