"""The reference design's own topology examples compile to the layouts its documents describe."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.plan import EdgeKind
from omni_server.compiler.render import topology_text
from tests.helpers.repo import make_repo, toml

TTS_MODEL = """\
[models.tts]
entry = "preprocessing"
tasks = ["speech"]
"""


def section(text: str, title: str) -> list[str]:
    """The lines of one `# title: ...` block of the topology printout."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"# {title}"))
    out = []
    for line in lines[start + 1 :]:
        if not line:
            break
        out.append(line)
    return out


@pytest.fixture
def higgs(tmp_path: Path) -> Path:
    """Higgs-TTS's four stages, each in a process of its own except tts_engine ("pipeline")."""
    return make_repo(
        tmp_path / "higgs",
        stages={
            "preprocessing": toml("""
                backend = "Pre"
                next = "audio_encoder"
            """),
            "audio_encoder": toml("""
                backend = "Enc"
                next = "tts_engine"
                gpu = 0
                gpu_memory_fraction = 0.1
            """),
            "tts_engine": toml("""
                backend = "Eng"
                process = "pipeline"
                next = "vocoder"
                stream_to = "vocoder"
                gpu = 0
                gpu_memory_fraction = 0.7
                [scheduler]
                kind = "stream"
                [engine]
                max_total_tokens = 16384
            """),
            "vocoder": toml("""
                backend = "Voc"
                process = "vocoder"
                terminal = true
                gpu = 0
                gpu_memory_fraction = 0.1
            """),
        },
        repository=TTS_MODEL,
    )


def test_higgs_frontend_grouping_by_override(higgs: Path) -> None:
    plan = compile_repository(
        higgs,
        [
            "--stages.preprocessing.process",
            "tts_frontend",
            "--stages.audio_encoder.process",
            "tts_frontend",
        ],
    )
    assert section(topology_text(plan), "processes") == [
        "tts_frontend : preprocessing, audio_encoder",
        "pipeline     : tts_engine",
        "vocoder      : vocoder",
    ]
    assert plan.same_process("preprocessing", "audio_encoder")
    assert not plan.same_process("audio_encoder", "tts_engine")
    # one OS process holding a CPU and a GPU stage says where each goes
    assert section(topology_text(plan), "instances")[0] == (
        "tts_frontend@r0 -> CPU: preprocessing; GPU 0: audio_encoder"
    )


def test_higgs_ungrouped_runs_each_stage_alone(higgs: Path) -> None:
    plan = compile_repository(higgs)
    assert [p.stages for p in plan.processes.values()] == [
        ("preprocessing",),
        ("audio_encoder",),
        ("tts_engine",),
        ("vocoder",),
    ]


def test_vocoder_isolation_and_sharing(higgs: Path) -> None:
    isolated = compile_repository(higgs)
    assert isolated.processes["vocoder"].stages == ("vocoder",)
    shared = compile_repository(higgs, ["--stages.vocoder.process", "pipeline"])
    assert "vocoder" not in shared.processes
    assert section(topology_text(shared), "processes")[-1] == "pipeline      : tts_engine, vocoder"
    assert shared.same_process("tts_engine", "vocoder")


QWEN3_OMNI = {
    "preprocessing": toml("""
        backend = "Pre"
        next = ["image_encoder", "audio_encoder", "mm_aggregate"]
    """),
    "image_encoder": toml("""
        backend = "Img"
        next = "mm_aggregate"
        gpu = 0
        gpu_memory_fraction = 0.05
    """),
    "audio_encoder": toml("""
        backend = "Aud"
        next = "mm_aggregate"
        gpu = 0
        gpu_memory_fraction = 0.05
    """),
    "mm_aggregate": toml("""
        backend = "Agg"
        wait_for = ["preprocessing", "image_encoder", "audio_encoder"]
        merge = "merge"
        next = "thinker"
    """),
    "thinker": toml("""
        backend = "Thinker"
        next = ["decode", "talker_ar"]
        stream_to = "talker_ar"
        gpu = 0
        gpu_memory_fraction = 0.8
        [scheduler]
        kind = "stream"
        [engine]
    """),
    "decode": toml("""
        backend = "Decode"
        terminal = true
    """),
    "talker_ar": toml("""
        backend = "Talker"
        next = "code2wav"
        stream_to = "code2wav"
        gpu = 1
        gpu_memory_fraction = 0.123
        [scheduler]
        kind = "stream"
        [engine]
    """),
    "code2wav": toml("""
        backend = "Code2Wav"
        terminal = true
        gpu = 1
        gpu_memory_fraction = 0.014
    """),
}

QWEN3_REPLICAS = """
[models.qwen3-omni]
entry = "preprocessing"
tasks = ["chat", "speech", "realtime"]

[processes.talker_ar]
num_replicas = 2
replica_devices = [1, 2]

[processes.code2wav]
num_replicas = 2
replica_devices = [1, 2]
"""


def test_qwen3_omni_two_replicas_across_gpus(tmp_path: Path) -> None:
    repo = make_repo(tmp_path / "qwen3", stages=QWEN3_OMNI, repository=QWEN3_REPLICAS)
    plan = compile_repository(repo)
    text = topology_text(plan)
    instances = section(text, "instances")
    for line in (
        "talker_ar@r0     -> GPU 1",
        "talker_ar@r1     -> GPU 2",
        "code2wav@r0      -> GPU 1",
        "code2wav@r1      -> GPU 2",
        "thinker@r0       -> GPU 0",
        "mm_aggregate@r0  -> CPU",
    ):
        assert line in instances
    assert section(text, "gpus") == [
        "GPU 0 : audio_encoder@r0 + image_encoder@r0 + thinker@r0  (0.9 of 1)",
        "GPU 1 : talker_ar@r0 + code2wav@r0  (0.137 of 1)",
        "GPU 2 : talker_ar@r1 + code2wav@r1  (0.137 of 1)",
    ]
    assert len(plan.instances) == 10  # 8 stages, two of them doubled
    assert plan.stages["mm_aggregate"].wait_for == (
        "preprocessing",
        "image_encoder",
        "audio_encoder",
    )
    kinds = {(e.src, e.dst, e.kind) for e in plan.edges}
    assert ("thinker", "talker_ar", EdgeKind.STREAM) in kinds
    assert ("thinker", "talker_ar", EdgeKind.NEXT) in kinds
    assert ("talker_ar", "code2wav", EdgeKind.STREAM) in kinds
    # a plan goes to child processes whole
    assert pickle.loads(pickle.dumps(plan)) == plan


def test_qwen3_omni_replica_devices_override_stage_gpu(tmp_path: Path) -> None:
    """Placement from replica_devices wins over the stage's own gpu, per replica."""
    repo = make_repo(tmp_path / "qwen3", stages=QWEN3_OMNI, repository=QWEN3_REPLICAS)
    plan = compile_repository(repo, ["--processes.code2wav.replica_devices", "[3, 4]"])
    assert [i.devices["code2wav"] for i in plan.instances_of("code2wav")] == [3, 4]
    assert [i.devices["talker_ar"] for i in plan.instances_of("talker_ar")] == [1, 2]


MOSS_STAGES = {
    "preprocessing": toml("""
        backend = "Pre"
        process = "pipeline"
        gpu = 0
        gpu_memory_fraction = 0.05
        next = "tts_engine"
        process_local = "tts_engine"
    """),
    "tts_engine": toml("""
        backend = "Eng"
        process = "pipeline"
        gpu = 0
        gpu_memory_fraction = 0.35
        next = "vocoder"
        stream_to = "vocoder"
        process_local = "vocoder"
        [scheduler]
        kind = "stream"
        [engine]
        max_total_tokens = 30000
    """),
    "vocoder": toml("""
        backend = "Voc"
        process = "pipeline"
        gpu = 0
        gpu_memory_fraction = 0.15
        terminal = true
    """),
}
MOSS_REPO = """
[server]
mps = "on"
weight_share = "on"

[models.mossl]
entry = "preprocessing"
tasks = ["speech"]

[processes.pipeline]
num_replicas = 2
replica_devices = [0, 0]
"""


def test_moss_two_replicas_on_one_gpu_with_weight_sharing(tmp_path: Path) -> None:
    plan = compile_repository(make_repo(tmp_path / "moss", MOSS_STAGES, MOSS_REPO))
    text = topology_text(plan)
    assert section(text, "processes") == ["pipeline : preprocessing, tts_engine, vocoder"]
    assert section(text, "instances") == ["pipeline@r0 -> GPU 0", "pipeline@r1 -> GPU 0"]
    # each replica budgets its process once (its largest stage fraction, 0.35): 2 x 0.35
    assert section(text, "gpus") == ["GPU 0 : pipeline@r0 + pipeline@r1  (0.7 of 1)"]
    assert plan.server.weight_share and plan.server.mps == "on"
    # inside one replicated process the process-local edges stay local
    assert all(plan.same_process(e.src, e.dst) for e in plan.edges if e.process_local)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["--stages.vocoder.process", "codec"], "edge tts_engine -> vocoder"),
        (["--stages.preprocessing.process", "pre"], "edge preprocessing -> tts_engine"),
    ],
)
def test_moss_split_rejects_process_local_edges(
    tmp_path: Path, overrides: list[str], fragment: str
) -> None:
    repo = make_repo(tmp_path / "moss", MOSS_STAGES, MOSS_REPO)
    with pytest.raises(RepositoryError, match=fragment) as info:
        compile_repository(repo, overrides)
    assert info.value.field == "process_local"


def test_moss_without_weight_share_needs_no_engine(tmp_path: Path) -> None:
    stages = dict(MOSS_STAGES)
    stages["tts_engine"] = stages["tts_engine"].replace("[engine]\nmax_total_tokens = 30000\n", "")
    repo = make_repo(tmp_path / "moss", stages, MOSS_REPO)
    with pytest.raises(RepositoryError, match="exactly one engine stage"):
        compile_repository(repo)
    plan = compile_repository(repo, ["--server.weight_share", "off"])
    assert not plan.server.weight_share


def test_replica_devices_leave_cpu_stages_on_the_host(higgs: Path) -> None:
    """A replica copies the whole process: its CPU stage stays on the host in every replica."""
    plan = compile_repository(
        higgs,
        [
            "--stages.preprocessing.process",
            "tts_frontend",
            "--stages.audio_encoder.process",
            "tts_frontend",
            "--processes.tts_frontend.num_replicas",
            "2",
            "--processes.tts_frontend.replica_devices",
            "1,2",
        ],
    )
    replicas = plan.instances_of("tts_frontend")
    assert [dict(i.devices) for i in replicas] == [
        {"preprocessing": None, "audio_encoder": 1},
        {"preprocessing": None, "audio_encoder": 2},
    ]
    assert section(topology_text(plan), "instances")[:2] == [
        "tts_frontend@r0 -> CPU: preprocessing; GPU 1: audio_encoder",
        "tts_frontend@r1 -> CPU: preprocessing; GPU 2: audio_encoder",
    ]


def test_tp_stage_materializes_one_process_per_rank(tmp_path: Path) -> None:
    repo = make_repo(
        tmp_path / "tp",
        stages={
            "preprocessing": toml("""
                backend = "Pre"
                next = "thinker"
            """),
            "thinker": toml("""
                backend = "T"
                terminal = true
                gpu = [2, 3]
                tp_size = 2
            """),
        },
        repository=TTS_MODEL,
    )
    plan = compile_repository(repo)
    assert plan.processes["thinker"].tp_size == 2
    ranks = plan.instances_of("thinker")
    assert [(i.name, i.tp_rank, i.devices["thinker"]) for i in ranks] == [
        ("thinker@r0/tp0", 0, 2),
        ("thinker@r0/tp1", 1, 3),
    ]
    assert not plan.same_process("preprocessing", "thinker")
