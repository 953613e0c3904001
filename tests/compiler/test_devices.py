"""Placement that follows the machine: `device = "auto"` and the [on_gpu] tables, resolved by
the pure compiler against machine facts handed in (no hardware is asked here), and the start
check that refuses a GPU asked for where there is none."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.plan import NO_GPU, DeviceRequest, MachineFacts, MpsMode
from omni_server.compiler.render import config_dict, topology_text
from omni_server.errors import PipelineError
from omni_server.gpu.devices import Gpu, Machine, check_placement
from tests.helpers.repo import make_repo, toml
from tests.helpers.server import ROOT, failed_start_line

HIGGS = ROOT / "examples" / "higgs-audio-v2"
ONE_GPU = MachineFacts(gpus=1)


def section(text: str, title: str) -> list[str]:
    """The lines of the `# title: ...` block of a topology printout."""
    block = text.split(f"# {title}:", 1)[1].split("\n\n", 1)[0]
    return block.splitlines()[1:]


def test_higgs_on_a_machine_without_a_gpu_runs_on_the_cpu_in_fp32() -> None:
    plan = compile_repository(HIGGS, machine=NO_GPU)
    assert all(not s.on_gpu for s in plan.stages.values())
    assert all(d is None for i in plan.instances for d in i.devices.values())
    engine = plan.stages["tts_engine"]
    assert engine.engine is not None and engine.engine.settings["dtype"] == "float32"
    assert engine.engine.max_total_tokens == 16384  # the file's, not [on_gpu]'s
    assert engine.gpu_memory_fraction is None and not engine.on_gpu_applied
    assert plan.server.mps is MpsMode.OFF and not plan.on_gpu_applied
    assert "gpu_memory_fraction" not in config_dict(plan)["stages"]["vocoder"]
    assert section(topology_text(plan), "devices") == [
        "preprocessing : cpu  (no device declared)",
        'audio_encoder : cpu  (device = "auto": no GPU found)',
        'tts_engine    : cpu float32  (device = "auto": no GPU found)',
        'vocoder       : cpu  (device = "auto": no GPU found)',
        "word_timing   : cpu  (no device declared)",
    ]


def test_higgs_on_a_machine_with_a_gpu_runs_on_cuda0_in_bf16_under_mps() -> None:
    plan = compile_repository(HIGGS, machine=ONE_GPU)
    placed = {s.name: (s.gpu, s.gpu_memory_fraction) for s in plan.stages.values()}
    assert placed == {
        "preprocessing": ((), None),
        "audio_encoder": ((0,), 0.05),
        "tts_engine": ((0,), 0.55),
        "vocoder": ((0,), 0.1),
        "word_timing": ((), None),  # the aligner runs on the CPU, in the vocoder's process
    }
    engine = plan.stages["tts_engine"]
    assert engine.device is DeviceRequest.AUTO and engine.on_gpu_applied
    assert engine.engine is not None and engine.engine.settings["dtype"] == "bfloat16"
    assert engine.engine.max_total_tokens == 65536
    # [on_gpu.engine] changes only the keys it names
    assert engine.engine.settings["max_batch_size"] == 64
    assert plan.stages["vocoder"].parameters["cuda_graphs"] is True  # the vocoder's graphs
    assert plan.server.mps is MpsMode.AUTO and plan.on_gpu_applied
    text = topology_text(plan)
    assert section(text, "gpus") == [
        "GPU 0 : tts_frontend@r0 + pipeline@r0 + vocoder@r0  (0.7 of 1)"
    ]
    assert 'tts_engine    : cuda:0 bfloat16  (device = "auto": 1 GPU found; [on_gpu] applied)' in (
        section(text, "devices")
    )
    assert "(this machine: 1 GPU found; [on_gpu] of repository.toml applied)" in text


def test_command_line_overrides_win_over_on_gpu() -> None:
    plan = compile_repository(
        HIGGS,
        [
            "--stages.tts_engine.engine.dtype", "float16",
            "--stages.vocoder.device", "cpu",
            "--server.mps", "off",
        ],
        machine=ONE_GPU,
    )  # fmt: skip
    engine = plan.stages["tts_engine"]
    assert engine.gpu == (0,) and engine.engine is not None
    assert engine.engine.settings["dtype"] == "float16"  # the override, over [on_gpu]'s
    assert engine.engine.max_total_tokens == 65536  # the rest of [on_gpu] still applies
    vocoder = plan.stages["vocoder"]
    assert vocoder.gpu == () and vocoder.gpu_memory_fraction is None
    assert plan.server.mps is MpsMode.OFF


def test_an_override_can_ask_for_the_gpu_on_a_machine_without_one() -> None:
    """`device = "gpu"` compiles anywhere (the plan says cuda:0 and that the machine lacks
    it); the runtime's start check refuses it, naming the stage."""
    plan = compile_repository(HIGGS, ["--stages.tts_engine.device", "gpu"], machine=NO_GPU)
    engine = plan.stages["tts_engine"]
    assert engine.gpu == (0,) and engine.on_gpu_applied
    assert engine.engine is not None and engine.engine.settings["dtype"] == "bfloat16"
    assert plan.server.mps is MpsMode.AUTO  # a stage is on a GPU: the repository's [on_gpu]
    line = next(x for x in section(topology_text(plan), "devices") if x.startswith("tts_engine"))
    assert line.endswith('(device = "gpu"; not on this machine: no GPU found; [on_gpu] applied)')
    with pytest.raises(PipelineError, match=r"stage tts_engine \(pipeline@r0\) wants cuda:0"):
        check_placement(plan, Machine(why_no_gpu="nvidia-smi not found"))
    check_placement(plan, Machine(gpus=(Gpu(0, "GPU-0"),)))  # one GPU: fine


def _repo(tmp_path: Path, synth: str, repository: str = "") -> Path:
    return make_repo(
        tmp_path / "repo",
        stages={
            "synth": toml('backend = "Synth"\nnext = "encoder"\n') + toml(synth),
            "encoder": toml('backend = "Encoder"\nterminal = true\n'),
        },
        repository=toml(repository) + toml('[models.m]\nentry = "synth"\ntasks = ["speech"]\n'),
    )


def test_auto_needs_every_gpu_of_the_stage(tmp_path: Path) -> None:
    root = _repo(tmp_path, 'device = "auto"\ntp_size = 2\n')
    assert compile_repository(root, machine=MachineFacts(gpus=2)).stages["synth"].gpu == (0, 1)
    plan = compile_repository(root, machine=ONE_GPU)
    assert plan.stages["synth"].gpu == () and plan.stages["synth"].tp_size == 2
    assert 'synth   : cpu  (device = "auto": 1 GPU found, not every one it needs)' in topology_text(
        plan
    )
    root = _repo(tmp_path / "ids", 'device = "auto"\ngpu = 1\n')
    assert compile_repository(root, machine=ONE_GPU).stages["synth"].gpu == ()
    assert compile_repository(root, machine=MachineFacts(gpus=2)).stages["synth"].gpu == (1,)


def test_device_cpu_keeps_the_gpu_fields_unused(tmp_path: Path) -> None:
    root = _repo(tmp_path, 'device = "cpu"\ngpu = 0\ngpu_memory_fraction = 0.4\n')
    synth = compile_repository(root, machine=ONE_GPU).stages["synth"]
    assert synth.gpu == () and synth.gpu_memory_fraction is None
    # and the override that moves a GPU stage off the GPU (issue 40: no override could)
    root = _repo(tmp_path / "gpu", "gpu = 0\ngpu_memory_fraction = 0.4\n")
    assert compile_repository(root, ["--stages.synth.device", "cpu"]).stages["synth"].gpu == ()


S, R = "synth/stage.toml", "repository.toml"


@pytest.mark.parametrize(
    ("synth", "repository", "file", "field", "fragment"),
    [
        ('[on_gpu]\ndevice = "gpu"\n', "", S, "on_gpu.device", "unknown field"),
        ('[on_gpu]\nnext = "x"\n', "", S, "on_gpu.next", "unknown field"),
        ('[on_gpu.engine]\ndtype = "fp8"\n', "", S, "on_gpu.engine.dtype", '"bfloat16"'),
        ("[on_gpu]\ngpu_memory_fraction = 2\n", "", S, "on_gpu.gpu_memory_fraction", "(0, 1]"),
        ("", '[on_gpu.models.m]\nentry = "x"\n', R, "on_gpu.models", "holds server, processes"),
        ("", '[on_gpu.server]\nmps = "yes"\n', R, "on_gpu.server.mps", '"auto"'),
        ("", "[on_gpu.processes.synth]\nreplicas = 2\n", R, "on_gpu.processes.synth.replicas",
         "unknown field"),
        ("", "on_gpu = 1\n", R, "on_gpu", "expected a table"),
    ],
)  # fmt: skip
def test_on_gpu_tables_are_checked_on_a_machine_without_a_gpu(
    tmp_path: Path, synth: str, repository: str, file: str, field: str, fragment: str
) -> None:
    root = _repo(tmp_path, 'device = "auto"\n' + synth, repository)
    with pytest.raises(RepositoryError) as caught:
        compile_repository(root, machine=NO_GPU)
    error = caught.value
    assert error.file == str(root / file) and error.field == field
    assert fragment in error.reason
    assert error.stage == ("synth" if file.startswith("synth") else None)


def test_a_rule_broken_by_on_gpu_says_so(tmp_path: Path) -> None:
    root = _repo(
        tmp_path,
        'device = "auto"\ngpu_memory_fraction = 0.5\n[on_gpu]\ngpu_memory_fraction = 0.9\n',
        "[on_gpu.processes.synth]\nnum_replicas = 2\nreplica_devices = [0, 0]\n",
    )
    compile_repository(root, machine=NO_GPU)  # the CPU: neither [on_gpu] applies
    with pytest.raises(RepositoryError) as caught:
        compile_repository(root, machine=ONE_GPU)
    error = caught.value
    assert error.stage == "synth" and error.field == "gpu_memory_fraction"
    assert "GPU 0 is over budget" in error.reason
    assert f"the value comes from [on_gpu] in {root / 'synth' / 'stage.toml'}" in error.reason
    assert "applied: 1 GPU found" in error.reason


def test_a_cpu_stage_still_budgets_no_gpu_memory(tmp_path: Path) -> None:
    root = _repo(tmp_path, "gpu_memory_fraction = 0.4\n")
    with pytest.raises(RepositoryError, match='set gpu \\(or device = "auto"\\) or drop it'):
        compile_repository(root)


@pytest.mark.slow  # a real server start, refused before any stage process
def test_a_gpu_asked_for_on_a_machine_without_one_exits_1_naming_the_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, also on a machine with one
    root = _repo(tmp_path, 'device = "gpu"\n')
    line = failed_start_line(root)
    assert "stage synth (synth@r0) wants cuda:0, but this machine has no usable CUDA GPU" in line


def test_a_group_model_control_loads_keeps_the_machine_and_the_parameters() -> None:
    """Model control starts each group of models from a subplan: it runs on the machine the
    plan was compiled for, with the repository's [parameters] (the checkpoint)."""
    from omni_server.compiler.partition import groups, subplan

    plan = compile_repository(HIGGS, ["--parameters.checkpoint", "/ckpt"], machine=ONE_GPU)
    ((models, stages),) = groups(plan, plan.models)
    part = subplan(plan, models, stages)
    assert part.machine == ONE_GPU and part.on_gpu_applied
    assert part.parameters == {"checkpoint": "/ckpt"}
    assert part.stages["tts_engine"].gpu == (0,)


def test_replica_devices_of_auto_stages_belong_in_on_gpu(tmp_path: Path) -> None:
    replicas = "[processes.synth]\nnum_replicas = 2\nreplica_devices = [0, 0]\n"
    root = _repo(tmp_path, 'device = "auto"\ngpu_memory_fraction = 0.4\n', replicas)
    with pytest.raises(RepositoryError, match=r"\[on_gpu.processes.synth\]"):
        compile_repository(root, machine=NO_GPU)
    root = _repo(
        tmp_path / "on_gpu",
        'device = "auto"\ngpu_memory_fraction = 0.4\n',
        "[on_gpu.processes.synth]\nnum_replicas = 2\nreplica_devices = [0, 0]\n",
    )
    assert compile_repository(root, machine=NO_GPU).processes["synth"].num_replicas == 1
    plan = compile_repository(root, machine=ONE_GPU)
    assert [i.devices["synth"] for i in plan.instances_of("synth")] == [0, 0]
