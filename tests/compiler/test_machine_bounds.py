"""A plan fits the machine it is compiled for (issue 42.2): a logical process runs at most one
OS process (replica x TP rank) per CPU core, and its stage processes together at least
PROCESS_MEMORY_FLOOR each of the memory. The facts are handed in (as `gpu.discover` finds
them); a compile without them (tests, Ray's driver) has no such bound. The same compile judges
a model control load's config, so `{"processes.voice.num_replicas": 6}` is refused before any
process starts (tests/serve/test_repository_api.py sends it over HTTP)."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.placement import PROCESS_MEMORY_FLOOR
from omni_server.compiler.plan import MachineFacts
from omni_server.gpu import host
from tests.helpers.repo import make_repo, toml

TWO_CORES = MachineFacts(cpus=2, memory_bytes=8 << 30)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_repo(
        tmp_path / "repo",
        stages={
            "frontend": toml("""
                backend = "F"
                next = "voice"
            """),
            "voice": toml("""
                backend = "V"
                terminal = true
            """),
        },
        repository=toml("""
            [models.tts]
            entry = "frontend"
            tasks = ["speech"]
            [processes.voice]
            num_replicas = 2
        """),
    )


def test_one_replica_per_core_is_accepted(repo: Path) -> None:
    plan = compile_repository(repo, machine=TWO_CORES)
    assert plan.processes["voice"].num_replicas == 2
    assert plan.machine == TWO_CORES


def test_the_probes_six_replicas_are_refused_naming_the_field(repo: Path) -> None:
    with pytest.raises(RepositoryError) as info:
        compile_repository(repo, ["--processes.voice.num_replicas=6"], TWO_CORES)
    err = info.value
    assert err.file is not None and err.file.endswith("repository.toml")
    assert (err.stage, err.field) == (None, "processes.voice.num_replicas")
    assert "6 OS processes" in err.reason and "2 CPU cores" in err.reason
    assert "at most 2 replicas" in err.reason
    assert "--processes.voice.num_replicas" in err.reason  # where the value came from


def test_a_cpu_tensor_parallel_stage_is_bounded_by_the_cores(repo: Path) -> None:
    with pytest.raises(RepositoryError) as info:
        compile_repository(
            repo,
            ["--processes.voice.num_replicas", "1", "--stages.voice.tp_size", "3"],
            TWO_CORES,
        )
    err = info.value
    assert err.file is not None and err.file.endswith("voice/stage.toml")
    assert (err.stage, err.field) == ("voice", "tp_size")
    assert "at most tp_size 2" in err.reason


def test_the_stage_processes_must_fit_the_memory(repo: Path) -> None:
    small = MachineFacts(cpus=64, memory_bytes=4 * PROCESS_MEMORY_FLOOR)
    compile_repository(repo, ["--processes.voice.num_replicas=3"], small)  # 4 processes fit
    with pytest.raises(RepositoryError) as info:
        compile_repository(repo, ["--processes.voice.num_replicas=4"], small)
    err = info.value
    assert err.field == "processes.voice.num_replicas"
    assert "5 stage processes" in err.reason and "MiB" in err.reason


def test_without_facts_there_is_no_machine_bound(repo: Path) -> None:
    plan = compile_repository(repo, ["--processes.voice.num_replicas=64"])
    assert len(plan.instances) == 65


def test_this_machines_facts_are_found() -> None:
    assert 1 <= host.cpus() <= 4096
    assert host.memory_bytes() > PROCESS_MEMORY_FLOOR
