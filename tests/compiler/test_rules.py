"""Every compiler rule, table-driven: each rule has accepted and rejected repositories.

A case starts from a small valid 3-stage TTS repository (frontend -> synth ~> encoder) and
changes stage descriptors, repository.toml or overrides. A rejected case names the file, stage
and field the error must name, and a fragment of the explanation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.plan import NO_SAMPLING, SamplingSpec
from omni_server.compiler.render import config_dict
from tests.helpers.repo import make_repo, toml

FRONTEND = """\
backend = "Frontend"
next = "synth"
"""
SYNTH = """\
backend = "Synth"
next = "encoder"
stream_to = "encoder"
[scheduler]
kind = "stream"
"""
ENCODER = """\
backend = "Encoder"
terminal = true
"""
# for cases where the encoder is tensor-parallel: a TP stage cannot be a stream target
PLAIN_SYNTH = """\
backend = "Synth"
next = "encoder"
"""
MODELS = """\
[models.tts]
entry = "frontend"
tasks = ["speech"]
voices = ["joe"]
"""


@dataclass
class Case:
    id: str
    stages: dict[str, str | None] = field(default_factory=dict)  # replaces / adds; None deletes
    repository: str = MODELS
    overrides: list[str] = field(default_factory=list)
    # rejected cases: (file name, stage, field, fragment of the message)
    error: tuple[str, str | None, str | None, str] | None = None


def build(tmp_path: Path, case: Case) -> Path:
    stages: dict[str, str | None] = {"frontend": FRONTEND, "synth": SYNTH, "encoder": ENCODER}
    stages.update(case.stages)
    return make_repo(
        tmp_path / "repo",
        stages={k: v for k, v in stages.items() if v is not None},
        repository=case.repository,
    )


def gpu_stage(cls: str, extra: str = "", terminal: bool = True) -> str:
    return f'backend = "{cls}"\n' + ("terminal = true\n" if terminal else "") + extra


SYNTH_TERMINAL = """\
backend = "Synth"
terminal = true
stream_to = "encoder"
[scheduler]
kind = "stream"
"""
ENDS_AT_SYNTH = MODELS + 'stages = ["frontend", "synth"]\n'

ACCEPTED = [
    Case("base"),
    Case("stream-to-only-successor", stages={"synth": SYNTH.replace('next = "encoder"\n', "")}),
    Case(
        "model-stages-end-at-a-shared-terminal",
        stages={"synth": SYNTH_TERMINAL},
        repository=ENDS_AT_SYNTH
        + toml("""
            [models.spoken]
            entry = "frontend"
            tasks = ["speech"]
        """),
    ),
    Case("backend-class-only-defaults-to-model-py"),
    Case(
        "backend-file-and-class",
        stages={
            "encoder": toml("""
                backend = "model.py:Encoder"
                terminal = true
            """)
        },
    ),
    Case(
        "route-among-next",
        stages={
            "frontend": toml("""
                backend = "F"
                next = ["synth", "encoder"]
                route = "choose"
            """),
        },
    ),
    Case(
        "fan-in-with-merge",
        stages={
            "frontend": toml("""
                backend = "F"
                next = ["synth", "side"]
            """),
            "side": toml("""
                backend = "S"
                next = "join"
            """),
            "synth": toml("""
                backend = "Y"
                next = "join"
            """),
            "join": toml("""
                backend = "J"
                wait_for = ["synth", "side"]
                merge = "merge"
                next = "encoder"
            """),
        },
    ),
    Case(
        "batch-scheduler",
        stages={
            "encoder": toml("""
                backend = "E"
                terminal = true
                [scheduler]
                kind = "batch"
                max_batch_size = 8
                max_queue_delay_ms = 5
            """),
        },
    ),
    Case(
        "engine-on-cpu",
        stages={
            "encoder": ENCODER
            + toml("""
                [engine]
                max_total_tokens = 4096
            """)
        },
    ),
    Case(
        "sampling-defaults",
        stages={
            "frontend": FRONTEND
            + toml("""
                [sampling]
                temperature = 0
                top_p = 1
                top_k = 40
                min_p = 0.05
                max_tokens = 64
            """)
        },
    ),
    Case(
        "parameters-free-form",
        stages={
            "encoder": ENCODER
            + toml("""
                [parameters]
                voice = "joe"
                rate = 22050
                [parameters.nested]
                x = [1, 2]
            """)
        },
    ),
    Case(
        "grouped-process",
        stages={
            "frontend": FRONTEND
            + toml("""
                process = "pipeline"
                process_local = "synth"
            """),
            "synth": SYNTH.replace("[scheduler]", 'process = "pipeline"\n[scheduler]'),
        },
    ),
    Case(
        "tp-on-cpu-ranks",
        stages={"synth": PLAIN_SYNTH, "encoder": ENCODER + "tp_size = 2\n"},
    ),
    Case(
        "tp-stage-owns-process",
        stages={
            "synth": PLAIN_SYNTH,
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = [0, 1]
                    tp_size = 2
                """),
            ),
        },
    ),
    Case(
        "cpu-replicas-need-no-devices",
        repository=MODELS
        + toml("""
            [processes.synth]
            num_replicas = 3
        """),
    ),
    Case(
        "least-loaded-binding",
        repository=MODELS
        + toml("""
            [processes.synth]
            num_replicas = 2
            binding = "least_loaded"
        """),
    ),
    Case(
        "round-robin-binding",
        repository=MODELS
        + toml("""
            [processes.synth]
            num_replicas = 2
            binding = "round_robin"
        """),
    ),
    Case(
        "binding-of-one-replica-is-harmless",
        repository=MODELS
        + toml("""
            [processes.synth]
            binding = "least_loaded"
        """),
    ),
    Case(
        "binding-by-override",
        repository=MODELS
        + toml("""
            [processes.synth]
            num_replicas = 2
        """),
        overrides=["--processes.synth.binding", "least_loaded"],
    ),
    Case(
        "gpu-replicas-on-two-gpus",
        stages={
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = 0
                    gpu_memory_fraction = 0.5
                """),
            ),
        },
        repository=MODELS
        + toml("""
            [processes.encoder]
            num_replicas = 2
            replica_devices = [1, 2]
        """),
    ),
    Case(
        "two-replicas-one-gpu-with-fractions",
        stages={
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = 0
                    gpu_memory_fraction = 0.5
                """),
            ),
        },
        repository=MODELS
        + toml("""
            [processes.encoder]
            num_replicas = 2
            replica_devices = [0, 0]
        """),
    ),
    Case(
        "tp-replicas-n-times-t",
        stages={
            "synth": PLAIN_SYNTH,
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = [0, 1]
                    tp_size = 2
                    gpu_memory_fraction = 0.4
                """),
            ),
        },
        repository=MODELS
        + toml("""
            [processes.encoder]
            num_replicas = 2
            replica_devices = [0, 1, 2, 3]
        """),
    ),
    Case(
        "processes-sharing-a-gpu-with-fractions",
        stages={
            "synth": toml("""
                backend = "Y"
                next = "encoder"
                gpu = 0
                gpu_memory_fraction = 0.6
            """),
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = 0
                    gpu_memory_fraction = 0.4
                """),
            ),
        },
    ),
    Case(
        "one-gpu-one-process-needs-no-fraction",
        stages={
            "synth": toml("""
                backend = "Y"
                next = "encoder"
                gpu = 0
                process = "p"
            """),
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = 0
                    process = "p"
                """),
            ),
        },
    ),
    Case(
        "fractions-fit-a-lowered-limit",
        stages={
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = 0
                    gpu_memory_fraction = 0.4
                """),
            ),
        },
        repository=MODELS
        + toml("""
            [server]
            gpu_memory_limit = 0.9
            [processes.encoder]
            num_replicas = 2
            replica_devices = [0, 0]
        """),
    ),
    Case(
        "weight-share-one-pinned-engine",
        stages={
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = 0
                    gpu_memory_fraction = 0.4
                    [engine]
                    max_total_tokens = 30000
                """),
            ),
        },
        repository=MODELS
        + toml("""
            [server]
            weight_share = "on"
            mps = "on"
            [processes.encoder]
            num_replicas = 2
            replica_devices = [0, 0]
        """),
    ),
    Case(
        "weight-share-without-sharing-group",
        repository=MODELS
        + toml("""
            [server]
            weight_share = "on"
        """),
    ),
    Case(
        "mps-auto",
        repository=MODELS
        + toml("""
            [server]
            mps = "auto"
        """),
    ),
    Case(
        "model-voices-and-aliases",
        repository=toml("""
            [models.tts]
            entry = "frontend"
            tasks = ["speech", "realtime"]
            aliases = ["tts-1"]
            voices = ["joe", "amy"]
            default_voice = "joe"
            description = "x"
            [models.tts.voice_aliases]
            alloy = "joe"
        """),
    ),
    Case(
        "two-models-two-entries",
        stages={
            "asr": toml("""
                backend = "A"
                terminal = true
            """)
        },
        repository=MODELS
        + toml("""
            [models.asr]
            entry = "asr"
            tasks = ["transcription"]
        """),
    ),
    Case(
        "route-stage-streams",
        stages={
            "synth": toml("""
                backend = "Y"
                next = ["encoder"]
                route = "pick"
                stream_to = ["encoder"]
                [scheduler]
                kind = "stream"
            """),
        },
    ),
    Case(
        "stream-only-target",  # the encoder gets chunks only; frontend's result goes to synth
        stages={
            "frontend": toml("""
                backend = "F"
                next = "synth"
                stream_to = "encoder"
                [scheduler]
                kind = "stream"
            """),
            "synth": toml("""
                backend = "Y"
                terminal = true
            """),
        },
    ),
    Case(
        "stream-into-an-ar-stage",  # its steps take the chunks (take_stream): the Higgs vocoder
        stages={
            "encoder": toml("""
                backend = "Encoder"
                terminal = true
                [scheduler]
                kind = "ar"
            """),
        },
    ),
    Case(
        "terminal-stage-streams",
        stages={
            "synth": toml("""
                backend = "Y"
                terminal = true
                stream_to = "encoder"
                [scheduler]
                kind = "stream"
            """),
        },
    ),
    Case(
        "hidden-folder-is-no-stage",
        stages={
            ".backup": toml("""
                backend = "B"
                terminal = true
            """)
        },
    ),
    Case(
        "override-regroups",
        overrides=["--stages.frontend.process", "pipeline", "--stages.synth.process", "pipeline"],
    ),
]

REJECTED = [
    Case(
        "model-stages-unknown",
        repository=MODELS + 'stages = ["frontend", "ghost"]\n',
        error=("repository.toml", None, "models.tts.stages", "no stage 'ghost'"),
    ),
    Case(
        "model-stages-without-entry",
        repository=MODELS + 'stages = ["synth", "encoder"]\n',
        error=("repository.toml", None, "models.tts.stages", "entry 'frontend' must be among"),
    ),
    Case(
        "model-stages-dead-end",
        repository=ENDS_AT_SYNTH,
        error=("repository.toml", None, "models.tts.stages", "'synth' is not terminal"),
    ),
    Case(
        "model-stages-unreachable",
        repository=MODELS + 'stages = ["frontend", "encoder"]\n',
        error=("repository.toml", None, "models.tts.stages", "does not reach encoder"),
    ),
    # -- files and fields --
    Case(
        "unknown-stage-field",
        stages={"encoder": ENCODER + "colour = 1\n"},
        error=("stage.toml", "encoder", "colour", "valid fields: backend, process"),
    ),
    Case(
        "wrong-type",
        stages={"encoder": ENCODER + 'tp_size = "2"\n'},
        error=("stage.toml", "encoder", "tp_size", "expected an integer"),
    ),
    Case(
        "bool-is-not-int",
        stages={"encoder": ENCODER + "tp_size = true\n"},
        error=("stage.toml", "encoder", "tp_size", "expected an integer"),
    ),
    Case(
        "unknown-scheduler-field",
        stages={
            "encoder": ENCODER
            + toml("""
                [scheduler]
                size = 2
            """)
        },
        error=("stage.toml", "encoder", "scheduler.size", "valid fields: kind"),
    ),
    Case(
        "bad-scheduler-kind",
        stages={
            "encoder": ENCODER
            + toml("""
                [scheduler]
                kind = "fast"
            """)
        },
        error=("stage.toml", "encoder", "scheduler.kind", '"single", "batch", "stream"'),
    ),
    Case(
        "batch-size-without-batch",
        stages={
            "encoder": ENCODER
            + toml("""
                [scheduler]
                max_batch_size = 4
            """)
        },
        error=("stage.toml", "encoder", "scheduler.max_batch_size", 'kind = "batch"'),
    ),
    Case(
        "bad-toml",
        stages={"encoder": "backend = \n"},
        error=("stage.toml", None, None, "not valid TOML"),
    ),
    Case(
        "missing-backend",
        stages={"encoder": "terminal = true\n"},
        error=("stage.toml", "encoder", "backend", "required"),
    ),
    Case(
        "backend-file-missing",
        stages={
            "encoder": toml("""
                backend = "other.py:E"
                terminal = true
            """)
        },
        error=("stage.toml", "encoder", "backend", "no file 'other.py'"),
    ),
    Case(
        "backend-outside-folder",
        stages={
            "encoder": toml("""
                backend = "../synth/model.py:E"
                terminal = true
            """)
        },
        error=("stage.toml", "encoder", "backend", "outside the stage folder"),
    ),
    Case(
        "backend-bad-form",
        stages={
            "encoder": toml("""
                backend = "model.py:"
                terminal = true
            """)
        },
        error=("stage.toml", "encoder", "backend", '"file.py:ClassName"'),
    ),
    Case(
        "unknown-repository-table",
        repository=MODELS
        + toml("""
            [extra]
            x = 1
        """),
        error=("repository.toml", None, "extra", "valid tables: server, models, processes"),
    ),
    Case(
        "unknown-server-field",
        repository=MODELS
        + toml("""
            [server]
            threads = 2
        """),
        error=("repository.toml", None, "server.threads", "valid fields: mps"),
    ),
    Case(
        "bad-mps",
        repository=MODELS
        + toml("""
            [server]
            mps = "yes"
        """),
        error=("repository.toml", None, "server.mps", '"off", "auto", "on"'),
    ),
    Case(
        "limit-out-of-range",
        repository=MODELS
        + toml("""
            [server]
            gpu_memory_limit = 1.5
        """),
        error=("repository.toml", None, "server.gpu_memory_limit", "(0, 1]"),
    ),
    Case(
        "fraction-out-of-range",
        stages={
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = 0
                    gpu_memory_fraction = 0
                """),
            )
        },
        error=("stage.toml", "encoder", "gpu_memory_fraction", "(0, 1]"),
    ),
    Case(
        "negative-gpu",
        stages={"encoder": gpu_stage("E", "gpu = -1\n")},
        error=("stage.toml", "encoder", "gpu", "integer"),
    ),
    Case(
        "empty-gpu-list",
        stages={"encoder": gpu_stage("E", "gpu = []\n")},
        error=("stage.toml", "encoder", "gpu", "names no GPU"),
    ),
    Case(
        "fraction-on-cpu-stage",
        stages={"encoder": gpu_stage("E", "gpu_memory_fraction = 0.5\n")},
        error=("stage.toml", "encoder", "gpu_memory_fraction", "CPU stage"),
    ),
    Case(
        "bad-process-name",
        stages={"encoder": ENCODER + 'process = "a.b"\n'},
        error=("stage.toml", "encoder", "process", "letters, digits"),
    ),
    # -- routing --
    Case(
        "next-and-terminal",
        stages={"encoder": ENCODER + 'next = "synth"\n'},
        error=("stage.toml", "encoder", "terminal", "terminal = true or next"),
    ),
    Case(
        "no-routing",
        stages={"encoder": 'backend = "E"\n'},
        error=("stage.toml", "encoder", "next", "no routing"),
    ),
    Case(
        "route-without-next",
        stages={"encoder": ENCODER + 'route = "pick"\n'},
        error=("stage.toml", "encoder", "route", "declare next"),
    ),
    Case(
        "route-not-a-method-name",
        stages={"frontend": FRONTEND + 'route = "a-b"\n'},
        error=("stage.toml", "frontend", "route", "not a method name"),
    ),
    Case(
        "next-target-missing",
        stages={
            "frontend": toml("""
                backend = "F"
                next = ["synth", "ghost"]
            """)
        },
        error=("stage.toml", "frontend", "next", "no stage 'ghost'"),
    ),
    Case(
        "next-listed-twice",
        stages={
            "frontend": toml("""
                backend = "F"
                next = ["synth", "synth"]
            """)
        },
        error=("stage.toml", "frontend", "next", "listed twice"),
    ),
    Case(
        "stream-target-missing",
        stages={
            "synth": SYNTH.replace('stream_to = "encoder"', 'stream_to = ["encoder", "ghost"]'),
        },
        error=("stage.toml", "synth", "stream_to", "no stage 'ghost'"),
    ),
    Case(
        "stream-from-non-stream-stage",
        stages={
            "synth": toml("""
                backend = "Y"
                next = "encoder"
                stream_to = "encoder"
            """)
        },
        error=("stage.toml", "synth", "stream_to", 'kind = "stream"'),
    ),
    Case(
        "self-loop",
        stages={
            "frontend": toml("""
                backend = "F"
                next = ["synth", "frontend"]
            """)
        },
        error=("stage.toml", "frontend", "next", "cannot name itself"),
    ),
    Case(
        "cycle",
        stages={
            "synth": toml("""
                backend = "Y"
                next = ["encoder", "frontend"]
            """),
            "start": toml("""
                backend = "S"
                next = "frontend"
            """),
        },
        repository=MODELS.replace('"frontend"', '"start"'),
        error=("stage.toml", "frontend", "next", "cycle: frontend -> synth -> frontend"),
    ),
    Case(
        "stream-cycle",
        stages={
            "encoder": toml("""
                backend = "E"
                terminal = true
                stream_to = "synth"
                [scheduler]
                kind = "stream"
            """),
        },
        error=("stage.toml", "encoder", "stream_to", "cycle: encoder -> synth -> encoder"),
    ),
    # -- fan-in --
    Case(
        "wait-for-without-merge",
        stages={
            "frontend": toml("""
                backend = "F"
                next = ["synth"]
            """),
            "synth": toml("""
                backend = "Y"
                next = "encoder"
                wait_for = ["frontend"]
            """),
        },
        error=("stage.toml", "synth", "merge", "wait_for needs merge"),
    ),
    Case(
        "merge-without-wait-for",
        stages={"encoder": ENCODER + 'merge = "m"\n'},
        error=("stage.toml", "encoder", "merge", "declare wait_for"),
    ),
    Case(
        "wait-for-missing-stage",
        stages={
            "synth": toml("""
                backend = "Y"
                next = "encoder"
                wait_for = ["frontend", "ghost"]
                merge = "m"
            """),
        },
        error=("stage.toml", "synth", "wait_for", "no stage 'ghost'"),
    ),
    Case(
        "wait-for-stage-not-feeding",
        stages={
            "frontend": toml("""
                backend = "F"
                next = ["synth", "side"]
            """),
            "side": toml("""
                backend = "S"
                terminal = true
            """),
            "synth": toml("""
                backend = "Y"
                next = "encoder"
                wait_for = ["frontend", "side"]
                merge = "m"
            """),
        },
        error=("stage.toml", "synth", "wait_for", "'side' never hands data to 'synth'"),
    ),
    Case(
        "sender-not-waited-for",
        stages={
            "frontend": toml("""
                backend = "F"
                next = ["synth", "side", "join"]
            """),
            "side": toml("""
                backend = "S"
                next = "join"
            """),
            "synth": toml("""
                backend = "Y"
                next = "join"
            """),
            "join": toml("""
                backend = "J"
                wait_for = ["synth", "side"]
                merge = "m"
                next = "encoder"
            """),
        },
        error=("stage.toml", "frontend", "next", "waits for ['synth', 'side'] only"),
    ),
    # -- models --
    Case("no-models", repository="", error=("repository.toml", None, "models", "at least one")),
    Case(
        "entry-missing",
        repository=MODELS.replace('"frontend"', '"ghost"'),
        error=("repository.toml", None, "models.tts.entry", "no stage 'ghost'"),
    ),
    Case(
        "entry-required",
        repository=toml("""
            [models.tts]
            tasks = ["speech"]
        """),
        error=("repository.toml", None, "models.tts.entry", "required"),
    ),
    Case(
        "entry-is-fan-in",
        stages={
            "frontend": toml("""
                backend = "F"
                next = "synth"
                wait_for = ["encoder"]
                merge = "m"
            """),
        },
        error=("stage.toml", "frontend", "wait_for", "never hands data"),
    ),
    Case(
        "bad-task",
        repository=MODELS.replace('"speech"', '"dance"'),
        error=(
            "repository.toml",
            None,
            "models.tts.tasks",
            "speech, transcription, chat, realtime",
        ),
    ),
    Case(
        "default-voice-unknown",
        repository=MODELS + 'default_voice = "amy"\n',
        error=("repository.toml", None, "models.tts.default_voice", "not among voices"),
    ),
    Case(
        "voice-alias-unknown-target",
        repository=MODELS
        + toml("""
            [models.tts.voice_aliases]
            alloy = "amy"
        """),
        error=("repository.toml", None, "models.tts.voice_aliases.alloy", "not among voices"),
    ),
    Case(
        "alias-taken",
        stages={
            "asr": toml("""
                backend = "A"
                terminal = true
            """)
        },
        repository=MODELS
        + toml("""
            aliases = ["x"]
            [models.asr]
            entry = "asr"
            tasks = ["transcription"]
            aliases = ["x"]
        """),
        error=("repository.toml", None, "models.asr.aliases", "already names model 'tts'"),
    ),
    Case(
        "unreachable-stage",
        stages={
            "orphan": toml("""
                backend = "O"
                terminal = true
            """)
        },
        error=("stage.toml", "orphan", None, "no served model reaches"),
    ),
    # -- TP --
    Case(
        "tp-gpu-count",
        stages={
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = [0, 1, 2]
                    tp_size = 2
                """),
            )
        },
        error=("stage.toml", "encoder", "gpu", "3 GPU ids for tp_size = 2"),
    ),
    Case(
        "tp-stage-as-stream-target",
        stages={"encoder": ENCODER + "tp_size = 2\n"},  # SYNTH streams to it
        error=("stage.toml", "synth", "stream_to", "tensor-parallel"),
    ),
    Case(
        "tp-ranks-share-gpu",
        stages={
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = [1, 1]
                    tp_size = 2
                """),
            )
        },
        error=("stage.toml", "encoder", "gpu", "TP ranks may not share a GPU"),
    ),
    Case(
        "tp-stage-shares-process",
        stages={
            "synth": toml("""
                backend = "Y"
                next = "encoder"
                process = "encoder"
            """),
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = [0, 1]
                    tp_size = 2
                """),
            ),
        },
        error=("stage.toml", "synth", "process", "owns its process"),
    ),
    Case(
        "tp-replica-ranks-share-gpu",
        stages={
            "synth": PLAIN_SYNTH,
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = [0, 1]
                    tp_size = 2
                    gpu_memory_fraction = 0.4
                """),
            ),
        },
        repository=MODELS
        + toml("""
            [processes.encoder]
            num_replicas = 2
            replica_devices = [0, 1, 2, 2]
        """),
        error=("repository.toml", None, "processes.encoder.replica_devices", "distinct GPUs"),
    ),
    # -- process-local edges --
    Case(
        "process-local-across-processes",
        stages={"frontend": FRONTEND + 'process_local = "synth"\n'},
        error=("stage.toml", "frontend", "process_local", "edge frontend -> synth would cross"),
    ),
    Case(
        "process-local-across-tp",
        stages={
            "synth": toml("""
                backend = "Y"
                next = "encoder"
                process_local = "encoder"
            """),
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = [0, 1]
                    tp_size = 2
                """),
            ),
        },
        error=("stage.toml", "synth", "process_local", "'encoder' is a TP stage"),
    ),
    Case(
        "process-local-not-a-successor",
        stages={"frontend": FRONTEND + 'process_local = "encoder"\n'},
        error=("stage.toml", "frontend", "process_local", "not a successor"),
    ),
    Case(
        "process-local-split-by-override",
        stages={
            "frontend": FRONTEND
            + toml("""
                process = "p"
                process_local = "synth"
            """),
            "synth": toml("""
                backend = "Y"
                next = "encoder"
                process = "p"
            """),
        },
        overrides=["--stages.synth.process", "q"],
        error=("stage.toml", "frontend", "process_local", "runs in process 'p'"),
    ),
    # -- replicas and placement --
    Case(
        "unknown-process",
        repository=MODELS
        + toml("""
            [processes.ghost]
            num_replicas = 2
        """),
        error=("repository.toml", None, "processes.ghost", "no stage runs in process 'ghost'"),
    ),
    Case(
        "unknown-process-field",
        repository=MODELS
        + toml("""
            [processes.synth]
            copies = 2
        """),
        error=("repository.toml", None, "processes.synth.copies", "num_replicas, replica_devices"),
    ),
    Case(
        "zero-replicas",
        repository=MODELS
        + toml("""
            [processes.synth]
            num_replicas = 0
        """),
        error=("repository.toml", None, "processes.synth.num_replicas", ">= 1"),
    ),
    Case(
        "unknown-binding",
        repository=MODELS
        + toml("""
            [processes.synth]
            num_replicas = 2
            binding = "random"
        """),
        error=(
            "repository.toml",
            None,
            "processes.synth.binding",
            'expected one of "round_robin", "least_loaded", got "random"',
        ),
    ),
    Case(
        "binding-not-a-string",
        repository=MODELS
        + toml("""
            [processes.synth]
            num_replicas = 2
            binding = 1
        """),
        error=("repository.toml", None, "processes.synth.binding", '"least_loaded", got 1'),
    ),
    Case(
        "binding-override-unknown",
        repository=MODELS
        + toml("""
            [processes.synth]
            num_replicas = 2
        """),
        overrides=["--processes.synth.binding", "fastest"],
        error=("command line", None, "processes.synth.binding", 'got "fastest"'),
    ),
    Case(
        "gpu-replicas-without-devices",
        stages={"encoder": gpu_stage("E", "gpu = 0\n")},
        repository=MODELS
        + toml("""
            [processes.encoder]
            num_replicas = 2
        """),
        error=("repository.toml", None, "processes.encoder.replica_devices", "must say where"),
    ),
    Case(
        "replica-devices-length",
        stages={
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = 0
                    gpu_memory_fraction = 0.2
                """),
            )
        },
        repository=MODELS
        + toml("""
            [processes.encoder]
            num_replicas = 2
            replica_devices = [1, 2, 3]
        """),
        error=("repository.toml", None, "processes.encoder.replica_devices", "give exactly 2"),
    ),
    Case(
        "replica-devices-n-times-t",
        stages={
            "synth": PLAIN_SYNTH,
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = [0, 1]
                    tp_size = 2
                    gpu_memory_fraction = 0.2
                """),
            ),
        },
        repository=MODELS
        + toml("""
            [processes.encoder]
            num_replicas = 2
            replica_devices = [1, 2]
        """),
        error=(
            "repository.toml",
            None,
            "processes.encoder.replica_devices",
            "x tp_size 2; give exactly 4",
        ),
    ),
    Case(
        "replica-devices-on-cpu-process",
        repository=MODELS
        + toml("""
            [processes.synth]
            replica_devices = [0]
        """),
        error=("repository.toml", None, "processes.synth.replica_devices", "only CPU stages"),
    ),
    # -- memory fractions --
    Case(
        "replicas-one-gpu-without-fraction",
        stages={"encoder": gpu_stage("E", "gpu = 0\n")},
        repository=MODELS
        + toml("""
            [processes.encoder]
            num_replicas = 2
            replica_devices = [0, 0]
        """),
        error=("stage.toml", "encoder", "gpu_memory_fraction", "replica_devices"),
    ),
    Case(
        "replica-devices-one-replica-needs-fraction",
        stages={"encoder": gpu_stage("E", "gpu = 0\n")},
        repository=MODELS
        + toml("""
            [processes.encoder]
            replica_devices = [3]
        """),
        error=("stage.toml", "encoder", "gpu_memory_fraction", "never inferred"),
    ),
    Case(
        "processes-share-gpu-without-fraction",
        stages={
            "synth": toml("""
                backend = "Y"
                next = "encoder"
                gpu = 0
                gpu_memory_fraction = 0.5
            """),
            "encoder": gpu_stage("E", "gpu = 0\n"),
        },
        error=(
            "stage.toml",
            "encoder",
            "gpu_memory_fraction",
            "GPU 0 is shared by encoder@r0, synth@r0",
        ),
    ),
    Case(
        "fractions-over-budget",
        stages={
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = 0
                    gpu_memory_fraction = 0.6
                """),
            )
        },
        repository=MODELS
        + toml("""
            [processes.encoder]
            num_replicas = 2
            replica_devices = [0, 0]
        """),
        error=(
            "stage.toml",
            "encoder",
            "gpu_memory_fraction",
            "GPU 0 is over budget: declared fractions sum to 1.2",
        ),
    ),
    Case(
        "fractions-over-lowered-limit",
        stages={
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = 0
                    gpu_memory_fraction = 0.5
                """),
            )
        },
        repository=MODELS
        + toml("""
            [server]
            gpu_memory_limit = 0.9
            [processes.encoder]
            num_replicas = 2
            replica_devices = [0, 0]
        """),
        error=("stage.toml", "encoder", "gpu_memory_fraction", "gpu_memory_limit 0.9"),
    ),
    # -- weight sharing --
    Case(
        "weight-share-without-engine",
        stages={
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = 0
                    gpu_memory_fraction = 0.4
                """),
            )
        },
        repository=MODELS
        + toml("""
            [server]
            weight_share = "on"
            [processes.encoder]
            num_replicas = 2
            replica_devices = [0, 0]
        """),
        error=("repository.toml", None, "server.weight_share", "exactly one engine stage"),
    ),
    Case(
        "weight-share-two-engines",
        stages={
            "synth": toml("""
                backend = "Y"
                next = "encoder"
                process = "p"
                gpu = 0
                gpu_memory_fraction = 0.1
                [engine]
                max_total_tokens = 1
            """),
            "encoder": gpu_stage(
                "E",
                toml("""
                    process = "p"
                    gpu = 0
                    gpu_memory_fraction = 0.3
                    [engine]
                    max_total_tokens = 1
                """),
            ),
        },
        repository=MODELS
        + toml("""
            [server]
            weight_share = "on"
            [processes.p]
            num_replicas = 2
            replica_devices = [0, 0]
        """),
        error=("repository.toml", None, "server.weight_share", "it has 2: synth, encoder"),
    ),
    Case(
        "weight-share-unpinned-budget",
        stages={
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = 0
                    gpu_memory_fraction = 0.4
                    [engine]
                """),
            ),
        },
        repository=MODELS
        + toml("""
            [server]
            weight_share = "on"
            [processes.encoder]
            num_replicas = 2
            replica_devices = [0, 0]
        """),
        error=("stage.toml", "encoder", "engine.max_total_tokens", "pinned KV budget"),
    ),
    Case(
        "weight-share-tp-engine",
        stages={
            "synth": PLAIN_SYNTH,
            "encoder": gpu_stage(
                "E",
                toml("""
                    gpu = [0, 1]
                    tp_size = 2
                    gpu_memory_fraction = 0.4
                    [engine]
                    max_total_tokens = 9
                """),
            ),
        },
        repository=MODELS
        + toml("""
            [server]
            weight_share = "on"
            [processes.encoder]
            num_replicas = 2
            replica_devices = [0, 1, 0, 1]
        """),
        error=("stage.toml", "encoder", "tp_size", "tp_size = 1"),
    ),
    Case(
        "sampling-temperature-above-2",
        stages={"frontend": FRONTEND + "[sampling]\ntemperature = 2.5\n"},
        error=("stage.toml", "frontend", "sampling.temperature", "a number in [0, 2], got 2.5"),
    ),
    Case(
        "sampling-top-p-zero",
        stages={"frontend": FRONTEND + "[sampling]\ntop_p = 0\n"},
        error=("stage.toml", "frontend", "sampling.top_p", "a number in (0, 1]"),
    ),
    Case(
        "sampling-max-tokens-zero",
        stages={"frontend": FRONTEND + "[sampling]\nmax_tokens = 0\n"},
        error=("stage.toml", "frontend", "sampling.max_tokens", "an integer >= 1, got 0"),
    ),
    Case(
        "sampling-min-p-text",
        stages={"frontend": FRONTEND + '[sampling]\nmin_p = "low"\n'},
        error=("stage.toml", "frontend", "sampling.min_p", "a number in [0, 1]"),
    ),
    Case(
        "sampling-repetition-penalty-unknown",
        stages={"frontend": FRONTEND + "[sampling]\nrepetition_penalty = 1.1\n"},
        error=("stage.toml", "frontend", "sampling.repetition_penalty", "valid fields: temp"),
    ),
]


def _ids(cases: list[Case]) -> list[str]:
    return [c.id for c in cases]


@pytest.mark.parametrize("case", ACCEPTED, ids=_ids(ACCEPTED))
def test_accepted(tmp_path: Path, case: Case) -> None:
    plan = compile_repository(build(tmp_path, case), case.overrides)
    assert set(plan.stages) >= {"frontend", "encoder"}
    assert plan.instances, "a compiled plan has at least one OS process"
    # every stage lives in exactly one logical process, and every instance's devices cover it
    members = [s for p in plan.processes.values() for s in p.stages]
    assert sorted(members) == sorted(plan.stages)
    for inst in plan.instances:
        assert set(inst.devices) == set(plan.processes[inst.process].stages)


@pytest.mark.parametrize("case", REJECTED, ids=_ids(REJECTED))
def test_rejected(tmp_path: Path, case: Case) -> None:
    assert case.error is not None
    file_name, stage, field_name, fragment = case.error
    with pytest.raises(RepositoryError) as info:
        compile_repository(build(tmp_path, case), case.overrides)
    err = info.value
    assert err.file is not None and err.file.endswith(file_name), err
    assert err.stage == stage, err
    assert err.field == field_name, err
    assert fragment in str(err), err
    assert "\n" not in str(err)
    # the one-line message names what it blames
    for part in (file_name, stage, field_name):
        if part is not None:
            assert part in str(err)


@pytest.mark.parametrize(
    ("repository", "overrides", "expected"),
    [
        (
            toml("""
                [processes.synth]
                num_replicas = 2
            """),
            [],
            "round_robin",
        ),  # the default
        (
            toml("""
                [processes.synth]
                num_replicas = 2
                binding = "least_loaded"
            """),
            [],
            "least_loaded",
        ),
        (
            toml("""
                [processes.synth]
                num_replicas = 2
                binding = "least_loaded"
            """),
            ["--processes.synth.binding", "round_robin"],
            "round_robin",
        ),
        ("", ["--processes.synth.binding", "least_loaded"], "least_loaded"),
    ],
)
def test_binding_reaches_the_plan(
    tmp_path: Path, repository: str, overrides: list[str], expected: str
) -> None:
    plan = compile_repository(build(tmp_path, Case("x", repository=MODELS + repository)), overrides)
    assert plan.processes["synth"].binding == expected
    assert {p.binding for n, p in plan.processes.items() if n != "synth"} == {"round_robin"}


def test_sampling_reaches_the_plan_and_the_model_of_its_entry(tmp_path: Path) -> None:
    (case,) = [c for c in ACCEPTED if c.id == "sampling-defaults"]
    plan = compile_repository(build(tmp_path, case))
    expected = SamplingSpec(temperature=0.0, top_p=1.0, top_k=40, min_p=0.05, max_tokens=64)
    assert plan.stages["frontend"].sampling == expected
    assert isinstance(plan.stages["frontend"].sampling.temperature, float)  # TOML's 0 is an int
    assert plan.models["tts"].sampling == expected  # frontend is the model's entry
    assert plan.stages["encoder"].sampling == NO_SAMPLING
    stages = config_dict(plan)["stages"]
    assert stages["frontend"]["sampling"] == expected.declared()
    assert "sampling" not in stages["encoder"]  # nothing declared, nothing printed


def test_missing_repository_file(tmp_path: Path) -> None:
    root = build(tmp_path, Case("x"))
    (root / "repository.toml").unlink()
    with pytest.raises(RepositoryError, match=r"missing repository\.toml") as info:
        compile_repository(root)
    assert info.value.file == str(root / "repository.toml")


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(RepositoryError, match="repository folder not found") as info:
        compile_repository(tmp_path / "nowhere")
    assert info.value.file == str(tmp_path / "nowhere")


def test_no_stages(tmp_path: Path) -> None:
    root = make_repo(tmp_path / "empty", stages={}, repository=MODELS)
    (root / "notes").mkdir()  # a folder without stage.toml is no stage
    with pytest.raises(RepositoryError, match="no stages: a stage is a sub-folder holding a"):
        compile_repository(root)


def test_stage_folder_name_must_fit_override_paths(tmp_path: Path) -> None:
    root = build(tmp_path, Case("x", stages={"tts.v2": ENCODER}))
    with pytest.raises(RepositoryError, match="letters, digits") as info:
        compile_repository(root)
    assert info.value.stage == "tts.v2"
