"""What a pipeline replica asks of Ray, read from the plan, and the command line and the
application builder refusing what is wrong before Ray starts (no cluster in these tests)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from omni_server.cluster.deployment import build_app
from omni_server.cluster.resources import Scaling, actor_options, deployment_options
from omni_server.compiler.compiler import compile_repository
from omni_server.serve.options import ServeOptions
from tests.cluster.conftest import REPOSITORY

GPU_VOICE = (
    "--stages.acoustic.gpu",
    "1",
    "--stages.acoustic.gpu_memory_fraction",
    "0.2",
    "--processes.voice.replica_devices",
    "0,1",
)


def test_one_cpu_per_stage_process_and_no_gpu_for_the_cpu_repository() -> None:
    plan = compile_repository(REPOSITORY, ["--processes.voice.num_replicas", "1"])
    assert actor_options(plan) == {"num_cpus": 3.0, "num_gpus": 0.0}  # voice, thinker, asr
    assert actor_options(compile_repository(REPOSITORY))["num_cpus"] == 4.0  # two voices


def test_the_gpus_are_the_highest_device_any_stage_uses_plus_one() -> None:
    plan = compile_repository(REPOSITORY, GPU_VOICE)
    assert actor_options(plan)["num_gpus"] == 2.0  # voice@r0 on cuda:0, voice@r1 on cuda:1


def test_capacity_is_the_models_admission_limit() -> None:
    plan = compile_repository(REPOSITORY)
    options = ServeOptions(max_in_flight=5, max_queued=7)
    fixed = deployment_options(plan, options, Scaling(num_replicas=3))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["max_ongoing_requests"] == 12 and fixed["max_queued_requests"] == 7
    auto = deployment_options(plan, options, Scaling.parse_autoscale("1:4"))
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"] == {
        "min_replicas": 1,
        "max_replicas": 4,
        "initial_replicas": 1,
        "target_ongoing_requests": 5,
    }


@pytest.mark.parametrize("text", ["4", "0:2", "3:1", "a:b", "1:"])
def test_a_bad_autoscale_range_names_what_is_wrong(text: str) -> None:
    with pytest.raises(ValueError, match="--autoscale wants"):
        Scaling.parse_autoscale(text)


def test_the_builder_reads_serve_run_arguments_and_refuses_unknown_ones() -> None:
    with pytest.raises(ValueError, match=r"needs args\.repo"):
        build_app({})
    with pytest.raises(ValueError, match="unknown args for omni-server's Serve app: colour"):
        build_app({"repo": str(REPOSITORY), "colour": "blue"})
    app = build_app(
        {"repo": str(REPOSITORY), "autoscale": "1:2", "max_in_flight": "3", "api_key": "k"}
    )
    assert app is not None


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "omni_server", "ray", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--repo", "/nonexistent/repository"), "/nonexistent/repository"),
        (("--repo", str(REPOSITORY), "--autoscale", "3:1"), "--autoscale wants 1 <= MIN <= MAX"),
        (("--repo", str(REPOSITORY), "--num-replicas", "0"), "--num-replicas must be at least 1"),
        (
            ("--repo", str(REPOSITORY), "--num-replicas", "2", "--autoscale", "1:2"),
            "not allowed with argument",
        ),
        (("--repo", str(REPOSITORY), "--stages.nope.process", "x"), "nope"),
    ],
)
def test_the_command_exits_2_before_ray_starts(args: tuple[str, ...], message: str) -> None:
    run = _cli(*args)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr and "Traceback" not in run.stderr


def test_the_help_names_the_guide() -> None:
    run = _cli("--help")
    assert run.returncode == 0 and "docs/scaling.md" in run.stdout and "--autoscale" in run.stdout
