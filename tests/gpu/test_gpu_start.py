"""GPU start checks: a GPU that a stage wants and the machine lacks is one line and exit 1, at
start, before any stage process; how the GPUs are numbered; which processes MPS serves; that
each replica placed by replica_devices really runs on its own GPU (gpu2)."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.plan import MpsMode, Plan
from omni_server.errors import PipelineError
from omni_server.gpu.devices import Gpu, Machine, discover, parse_smi, visible
from omni_server.gpu.mps import clients
from omni_server.pipeline import Runtime
from tests.fixtures import FIXTURES
from tests.helpers.repo import make_repo, toml
from tests.helpers.runtime import running
from tests.helpers.server import failed_start_line

pytestmark = pytest.mark.timeout(120)

PROBE = FIXTURES / "gpu_stages.py"
MODELS = """\
[models.m]
entry = "a"
tasks = ["speech"]
"""


def gpu_repo(root: Path, stages: dict[str, str], processes: str = "", server: str = "") -> Path:
    """Stages of DeviceProbe (stage.toml bodies given), model m entering at stage a."""
    head = f"[server]\n{server}\n" if server else ""
    descriptors = {n: 'backend = "model.py:DeviceProbe"\n' + s for n, s in stages.items()}
    return make_repo(root, descriptors, head + MODELS + processes, dict.fromkeys(stages, PROBE))


def fake_machine(n: int, mps_control: str | None = None) -> Machine:
    """n GPUs that exist only in this description (the CPU tests' stand-in for discovery)."""
    return Machine(tuple(Gpu(i, f"GPU-fake-{i}") for i in range(n)), mps_control=mps_control)


ONE_GPU_STAGE = {
    "a": toml("""
        terminal = true
        gpu = 0
        [parameters]
        compute = false
    """)
}


# ---- the command line: exit 1 and one line --------------------------------------------------


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has GPUs")
@pytest.mark.parametrize("mps", ["off", "auto", "on"])
def test_gpu_stage_without_a_gpu_exits_1_with_one_line(tmp_path, mps):
    repo = gpu_repo(tmp_path / "repo", ONE_GPU_STAGE, server=f'mps = "{mps}"')
    assert failed_start_line(repo, timeout=60).endswith(
        "stage a (a@r0) wants cuda:0, but this machine has no usable CUDA GPU "
        "(nvidia-smi not found)"
    )


# ---- the runtime: checks before any process ----------------------------------------------------


async def _start_fails(plan: Plan, machine: Machine) -> str:
    runtime = Runtime(plan, machine=machine)
    with pytest.raises(PipelineError) as failed:
        await runtime.start()
    assert runtime.processes() == {} and runtime.run_dir is None  # nothing was spawned
    await runtime.stop()
    return failed.value.message


async def test_a_replica_device_past_the_last_gpu_is_named(tmp_path):
    stages = {
        "a": toml("""
            terminal = true
            gpu = 0
            gpu_memory_fraction = 0.3
        """)
    }
    processes = toml("""
        [processes.a]
        num_replicas = 2
        replica_devices = [0, 3]
    """)
    plan = compile_repository(gpu_repo(tmp_path, stages, processes))
    message = await _start_fails(plan, fake_machine(2))
    assert message == "stage a (a@r1) wants cuda:3, but this machine has 2 GPUs (0-1)"


async def test_a_stage_device_past_the_only_gpu_is_named(tmp_path):
    stages = {
        "a": 'next = "b"\n',
        "b": toml("""
            terminal = true
            gpu = 1
        """),
    }
    plan = compile_repository(gpu_repo(tmp_path, stages))
    message = await _start_fails(plan, fake_machine(1))
    assert message == "stage b (b@r0) wants cuda:1, but this machine has 1 GPU (0)"


async def test_gpu_stages_on_gpus_that_exist_start(tmp_path):
    stages = {
        "a": 'next = "b"\n',
        "b": toml("""
            terminal = true
            gpu = 0
            gpu_memory_fraction = 0.3
            [parameters]
            compute = false
        """),
    }
    processes = toml("""
        [processes.b]
        num_replicas = 2
        replica_devices = [1, 0]
    """)
    plan = compile_repository(gpu_repo(tmp_path, stages, processes))
    async with running(plan, machine=fake_machine(2)) as runtime:
        out = await runtime.submit(plan.models["m"], {}).result()
        assert out["stage"] == "b" and out["mps_pipe"] is None  # mps is off by default
        placed = {inst.name: inst.devices["b"] for inst in plan.instances if inst.process == "b"}
        assert placed == {"b@r0": 1, "b@r1": 0}


# ---- discovery --------------------------------------------------------------------------------

SMI = "0, GPU-aaaa-1111\n1, GPU-bbbb-2222\n2, GPU-cccc-3333\n"


def test_nvidia_smi_lines_become_gpus_in_index_order():
    gpus = parse_smi("1, GPU-bbbb-2222\n0, GPU-aaaa-1111\nNo devices were found\n")
    assert gpus == (Gpu(0, "GPU-aaaa-1111"), Gpu(1, "GPU-bbbb-2222"))


@pytest.mark.parametrize(
    ("setting", "uuids"),
    [
        (None, ["GPU-aaaa-1111", "GPU-bbbb-2222", "GPU-cccc-3333"]),
        ("2,0", ["GPU-cccc-3333", "GPU-aaaa-1111"]),
        ("GPU-bbbb", ["GPU-bbbb-2222"]),  # a UUID prefix, as CUDA accepts
        ("1,7,0", ["GPU-bbbb-2222"]),  # the list ends at the first entry naming no GPU
        ("", []),
        ("-1", []),
        ("1,1", ["GPU-bbbb-2222"]),  # a repeated GPU ends it too
    ],
)
def test_cuda_visible_devices_selects_and_renumbers(setting, uuids):
    gpus = visible(parse_smi(SMI), setting)
    assert [g.uuid for g in gpus] == uuids
    assert [g.index for g in gpus] == list(range(len(uuids)))  # cuda:N is the N-th visible


def test_discovery_without_nvidia_smi_finds_no_gpu(tmp_path):
    machine = discover({"PATH": str(tmp_path)})  # an empty folder: no nvidia-smi, no MPS
    assert machine.gpus == () and machine.mps_control is None
    assert machine.why_no_gpu == "nvidia-smi not found"


def test_discovery_reads_nvidia_smi_and_finds_the_mps_control(tmp_path):
    # stands in for the driver's tools: the runtime's parsing and PATH lookup are real
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '{SMI}'\n")
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text("#!/bin/sh\nexit 0\n")
    for tool in (smi, control):
        tool.chmod(0o755)
    machine = discover({"PATH": str(tmp_path), "CUDA_VISIBLE_DEVICES": "GPU-cccc"})
    assert machine.gpus == (Gpu(0, "GPU-cccc-3333"),)
    assert machine.mps_control == str(control)


# ---- which processes MPS serves ----------------------------------------------------------------


def test_mps_clients_auto_takes_shared_gpus_on_takes_every_single_gpu_process(tmp_path):
    fraction = "gpu_memory_fraction = 0.2"
    stages = {
        "a": toml(f"""
            next = "b"
            process = "front"
            gpu = 0
            {fraction}
        """),
        "b": toml(f"""
            next = "c"
            process = "back"
            gpu = 0
            {fraction}
        """),
        "c": toml(f"""
            next = "d"
            process = "alone"
            gpu = 1
            {fraction}
        """),
        "d": toml("""
            terminal = true
            process = "cpu"
        """),
    }
    plan = compile_repository(gpu_repo(tmp_path, stages))
    index = {inst.process: i for i, inst in enumerate(plan.instances)}
    assert clients(plan, MpsMode.OFF) == {}
    # auto: only GPU 0 hosts two processes; the CPU process is never a client
    assert clients(plan, MpsMode.AUTO) == {index["front"]: 0, index["back"]: 0}
    assert clients(plan, MpsMode.ON) == {index["front"]: 0, index["back"]: 0, index["alone"]: 1}


def test_mps_clients_count_replicas_on_one_gpu(tmp_path):
    stages = {
        "a": toml("""
            terminal = true
            gpu = 0
            gpu_memory_fraction = 0.4
        """)
    }
    processes = toml("""
        [processes.a]
        num_replicas = 3
        replica_devices = [1, 1, 0]
    """)
    plan = compile_repository(gpu_repo(tmp_path, stages, processes))
    assert clients(plan, MpsMode.AUTO) == {0: 1, 1: 1}  # replicas 0 and 1 share GPU 1


# ---- on the GPUs --------------------------------------------------------------------------------


@pytest.mark.gpu2
@pytest.mark.parametrize("mps", ["off", "on"])
async def test_replicas_over_two_gpus_each_run_on_their_own(tmp_path, mps):
    stages = {
        "a": toml("""
            terminal = true
            gpu = 0
            gpu_memory_fraction = 0.2
        """)
    }
    processes = toml("""
        [processes.a]
        num_replicas = 2
        replica_devices = [0, 1]
    """)
    plan = compile_repository(gpu_repo(tmp_path, stages, processes, server=f'mps = "{mps}"'))
    machine = discover(os.environ)
    async with running(plan) as runtime:
        model = plan.models["m"]
        outs = await asyncio.gather(*(runtime.submit(model, {}).result() for _ in range(4)))
    by_replica = {o["replica"]: o for o in outs}
    assert sorted(by_replica) == [0, 1]  # round robin reached both
    for replica, out in by_replica.items():
        assert out["context_device"] == f"cuda:{replica}"
        assert out["tensor_device"] == f"cuda:{replica}"
        assert out["current_device"] == replica
        # the physical GPU, by UUID: cuda:N is the server's N-th GPU, with or without MPS
        assert machine.gpus[replica].uuid.endswith(out["uuid"])
        assert out["sum"] == pytest.approx(512.0, rel=1e-3)
        assert (out["mps_pipe"] is not None) == (mps == "on")
    assert by_replica[0]["pid"] != by_replica[1]["pid"]
