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
from tests.helpers.repo import make_repo

FRONTEND = 'backend = "Frontend"\nnext = "synth"\n'
SYNTH = 'backend = "Synth"\nnext = "encoder"\nstream_to = "encoder"\n[scheduler]\nkind = "stream"\n'
ENCODER = 'backend = "Encoder"\nterminal = true\n'
# for cases where the encoder is tensor-parallel: a TP stage cannot be a stream target
PLAIN_SYNTH = 'backend = "Synth"\nnext = "encoder"\n'
MODELS = '[models.tts]\nentry = "frontend"\ntasks = ["speech"]\nvoices = ["joe"]\n'


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


SYNTH_TERMINAL = (
    'backend = "Synth"\nterminal = true\nstream_to = "encoder"\n[scheduler]\nkind = "stream"\n'
)
ENDS_AT_SYNTH = MODELS + 'stages = ["frontend", "synth"]\n'

ACCEPTED = [
    Case("base"),
    Case("stream-to-only-successor", stages={"synth": SYNTH.replace('next = "encoder"\n', "")}),
    Case(
        "model-stages-end-at-a-shared-terminal",
        stages={"synth": SYNTH_TERMINAL},
        repository=ENDS_AT_SYNTH + '[models.spoken]\nentry = "frontend"\ntasks = ["speech"]\n',
    ),
    Case("backend-class-only-defaults-to-model-py"),
    Case(
        "backend-file-and-class",
        stages={"encoder": 'backend = "model.py:Encoder"\nterminal = true'},
    ),
    Case(
        "route-among-next",
        stages={
            "frontend": 'backend = "F"\nnext = ["synth", "encoder"]\nroute = "choose"',
        },
    ),
    Case(
        "fan-in-with-merge",
        stages={
            "frontend": 'backend = "F"\nnext = ["synth", "side"]',
            "side": 'backend = "S"\nnext = "join"',
            "synth": 'backend = "Y"\nnext = "join"',
            "join": 'backend = "J"\nwait_for = ["synth", "side"]\nmerge = "merge"\n'
            'next = "encoder"',
        },
    ),
    Case(
        "batch-scheduler",
        stages={
            "encoder": 'backend = "E"\nterminal = true\n[scheduler]\nkind = "batch"\n'
            "max_batch_size = 8\nmax_queue_delay_ms = 5",
        },
    ),
    Case("engine-on-cpu", stages={"encoder": ENCODER + "[engine]\nmax_total_tokens = 4096\n"}),
    Case(
        "parameters-free-form",
        stages={
            "encoder": ENCODER
            + '[parameters]\nvoice = "joe"\nrate = 22050\n[parameters.nested]\nx = [1, 2]\n'
        },
    ),
    Case(
        "grouped-process",
        stages={
            "frontend": FRONTEND + 'process = "pipeline"\nprocess_local = "synth"\n',
            "synth": SYNTH.replace("[scheduler]", 'process = "pipeline"\n[scheduler]'),
        },
    ),
    Case(
        "tp-on-cpu-ranks",
        stages={"synth": PLAIN_SYNTH, "encoder": ENCODER + "tp_size = 2\n"},
    ),
    Case(
        "tp-stage-owns-process",
        stages={"synth": PLAIN_SYNTH, "encoder": gpu_stage("E", "gpu = [0, 1]\ntp_size = 2\n")},
    ),
    Case(
        "cpu-replicas-need-no-devices", repository=MODELS + "[processes.synth]\nnum_replicas = 3\n"
    ),
    Case(
        "least-loaded-binding",
        repository=MODELS + '[processes.synth]\nnum_replicas = 2\nbinding = "least_loaded"\n',
    ),
    Case(
        "round-robin-binding",
        repository=MODELS + '[processes.synth]\nnum_replicas = 2\nbinding = "round_robin"\n',
    ),
    Case(
        "binding-of-one-replica-is-harmless",
        repository=MODELS + '[processes.synth]\nbinding = "least_loaded"\n',
    ),
    Case(
        "binding-by-override",
        repository=MODELS + "[processes.synth]\nnum_replicas = 2\n",
        overrides=["--processes.synth.binding", "least_loaded"],
    ),
    Case(
        "gpu-replicas-on-two-gpus",
        stages={
            "encoder": gpu_stage("E", "gpu = 0\ngpu_memory_fraction = 0.5\n"),
        },
        repository=MODELS + "[processes.encoder]\nnum_replicas = 2\nreplica_devices = [1, 2]\n",
    ),
    Case(
        "two-replicas-one-gpu-with-fractions",
        stages={
            "encoder": gpu_stage("E", "gpu = 0\ngpu_memory_fraction = 0.5\n"),
        },
        repository=MODELS + "[processes.encoder]\nnum_replicas = 2\nreplica_devices = [0, 0]\n",
    ),
    Case(
        "tp-replicas-n-times-t",
        stages={
            "synth": PLAIN_SYNTH,
            "encoder": gpu_stage("E", "gpu = [0, 1]\ntp_size = 2\ngpu_memory_fraction = 0.4\n"),
        },
        repository=MODELS
        + "[processes.encoder]\nnum_replicas = 2\nreplica_devices = [0, 1, 2, 3]\n",
    ),
    Case(
        "processes-sharing-a-gpu-with-fractions",
        stages={
            "synth": 'backend = "Y"\nnext = "encoder"\ngpu = 0\ngpu_memory_fraction = 0.6\n',
            "encoder": gpu_stage("E", "gpu = 0\ngpu_memory_fraction = 0.4\n"),
        },
    ),
    Case(
        "one-gpu-one-process-needs-no-fraction",
        stages={
            "synth": 'backend = "Y"\nnext = "encoder"\ngpu = 0\nprocess = "p"\n',
            "encoder": gpu_stage("E", 'gpu = 0\nprocess = "p"\n'),
        },
    ),
    Case(
        "fractions-fit-a-lowered-limit",
        stages={
            "encoder": gpu_stage("E", "gpu = 0\ngpu_memory_fraction = 0.4\n"),
        },
        repository=MODELS + "[server]\ngpu_memory_limit = 0.9\n[processes.encoder]\n"
        "num_replicas = 2\nreplica_devices = [0, 0]\n",
    ),
    Case(
        "weight-share-one-pinned-engine",
        stages={
            "encoder": gpu_stage(
                "E", "gpu = 0\ngpu_memory_fraction = 0.4\n[engine]\nmax_total_tokens = 30000\n"
            ),
        },
        repository=MODELS + '[server]\nweight_share = "on"\nmps = "on"\n[processes.encoder]\n'
        "num_replicas = 2\nreplica_devices = [0, 0]\n",
    ),
    Case(
        "weight-share-without-sharing-group", repository=MODELS + '[server]\nweight_share = "on"\n'
    ),
    Case("mps-auto", repository=MODELS + '[server]\nmps = "auto"\n'),
    Case(
        "model-voices-and-aliases",
        repository='[models.tts]\nentry = "frontend"\n'
        'tasks = ["speech", "realtime"]\naliases = ["tts-1"]\nvoices = ["joe", "amy"]\n'
        'default_voice = "joe"\ndescription = "x"\n[models.tts.voice_aliases]\nalloy = "joe"\n',
    ),
    Case(
        "two-models-two-entries",
        stages={"asr": 'backend = "A"\nterminal = true'},
        repository=MODELS + '[models.asr]\nentry = "asr"\ntasks = ["transcription"]\n',
    ),
    Case(
        "route-stage-streams",
        stages={
            "synth": 'backend = "Y"\nnext = ["encoder"]\nroute = "pick"\nstream_to = ["encoder"]\n'
            '[scheduler]\nkind = "stream"\n',
        },
    ),
    Case(
        "stream-only-target",  # the encoder gets chunks only; frontend's result goes to synth
        stages={
            "frontend": 'backend = "F"\nnext = "synth"\nstream_to = "encoder"\n'
            '[scheduler]\nkind = "stream"\n',
            "synth": 'backend = "Y"\nterminal = true\n',
        },
    ),
    Case(
        "terminal-stage-streams",
        stages={
            "synth": 'backend = "Y"\nterminal = true\nstream_to = "encoder"\n'
            '[scheduler]\nkind = "stream"\n',
        },
    ),
    Case(
        "hidden-folder-is-no-stage",
        stages={".backup": 'backend = "B"\nterminal = true\n'},
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
        stages={"encoder": ENCODER + "[scheduler]\nsize = 2\n"},
        error=("stage.toml", "encoder", "scheduler.size", "valid fields: kind"),
    ),
    Case(
        "bad-scheduler-kind",
        stages={"encoder": ENCODER + '[scheduler]\nkind = "fast"\n'},
        error=("stage.toml", "encoder", "scheduler.kind", '"single", "batch", "stream"'),
    ),
    Case(
        "batch-size-without-batch",
        stages={"encoder": ENCODER + "[scheduler]\nmax_batch_size = 4\n"},
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
        stages={"encoder": 'backend = "other.py:E"\nterminal = true\n'},
        error=("stage.toml", "encoder", "backend", "no file 'other.py'"),
    ),
    Case(
        "backend-outside-folder",
        stages={"encoder": 'backend = "../synth/model.py:E"\nterminal = true\n'},
        error=("stage.toml", "encoder", "backend", "outside the stage folder"),
    ),
    Case(
        "backend-bad-form",
        stages={"encoder": 'backend = "model.py:"\nterminal = true\n'},
        error=("stage.toml", "encoder", "backend", '"file.py:ClassName"'),
    ),
    Case(
        "unknown-repository-table",
        repository=MODELS + "[extra]\nx = 1\n",
        error=("repository.toml", None, "extra", "valid tables: server, models, processes"),
    ),
    Case(
        "unknown-server-field",
        repository=MODELS + "[server]\nthreads = 2\n",
        error=("repository.toml", None, "server.threads", "valid fields: mps"),
    ),
    Case(
        "bad-mps",
        repository=MODELS + '[server]\nmps = "yes"\n',
        error=("repository.toml", None, "server.mps", '"off", "auto", "on"'),
    ),
    Case(
        "limit-out-of-range",
        repository=MODELS + "[server]\ngpu_memory_limit = 1.5\n",
        error=("repository.toml", None, "server.gpu_memory_limit", "(0, 1]"),
    ),
    Case(
        "fraction-out-of-range",
        stages={"encoder": gpu_stage("E", "gpu = 0\ngpu_memory_fraction = 0\n")},
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
        stages={"frontend": 'backend = "F"\nnext = ["synth", "ghost"]\n'},
        error=("stage.toml", "frontend", "next", "no stage 'ghost'"),
    ),
    Case(
        "next-listed-twice",
        stages={"frontend": 'backend = "F"\nnext = ["synth", "synth"]\n'},
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
        stages={"synth": 'backend = "Y"\nnext = "encoder"\nstream_to = "encoder"\n'},
        error=("stage.toml", "synth", "stream_to", 'kind = "stream"'),
    ),
    Case(
        "self-loop",
        stages={"frontend": 'backend = "F"\nnext = ["synth", "frontend"]\n'},
        error=("stage.toml", "frontend", "next", "cannot name itself"),
    ),
    Case(
        "cycle",
        stages={
            "synth": 'backend = "Y"\nnext = ["encoder", "frontend"]\n',
            "start": 'backend = "S"\nnext = "frontend"\n',
        },
        repository=MODELS.replace('"frontend"', '"start"'),
        error=("stage.toml", "frontend", "next", "cycle: frontend -> synth -> frontend"),
    ),
    Case(
        "stream-cycle",
        stages={
            "encoder": 'backend = "E"\nterminal = true\nstream_to = "synth"\n'
            '[scheduler]\nkind = "stream"\n',
        },
        error=("stage.toml", "encoder", "stream_to", "cycle: encoder -> synth -> encoder"),
    ),
    # -- fan-in --
    Case(
        "wait-for-without-merge",
        stages={
            "frontend": 'backend = "F"\nnext = ["synth"]\n',
            "synth": 'backend = "Y"\nnext = "encoder"\nwait_for = ["frontend"]\n',
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
            "synth": 'backend = "Y"\nnext = "encoder"\nwait_for = ["frontend", "ghost"]\n'
            'merge = "m"\n',
        },
        error=("stage.toml", "synth", "wait_for", "no stage 'ghost'"),
    ),
    Case(
        "wait-for-stage-not-feeding",
        stages={
            "frontend": 'backend = "F"\nnext = ["synth", "side"]\n',
            "side": 'backend = "S"\nterminal = true\n',
            "synth": 'backend = "Y"\nnext = "encoder"\nwait_for = ["frontend", "side"]\n'
            'merge = "m"\n',
        },
        error=("stage.toml", "synth", "wait_for", "'side' never hands data to 'synth'"),
    ),
    Case(
        "sender-not-waited-for",
        stages={
            "frontend": 'backend = "F"\nnext = ["synth", "side", "join"]\n',
            "side": 'backend = "S"\nnext = "join"\n',
            "synth": 'backend = "Y"\nnext = "join"\n',
            "join": 'backend = "J"\nwait_for = ["synth", "side"]\nmerge = "m"\nnext = "encoder"\n',
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
        repository='[models.tts]\ntasks = ["speech"]\n',
        error=("repository.toml", None, "models.tts.entry", "required"),
    ),
    Case(
        "entry-is-fan-in",
        stages={
            "frontend": 'backend = "F"\nnext = "synth"\nwait_for = ["encoder"]\nmerge = "m"\n',
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
        repository=MODELS + '[models.tts.voice_aliases]\nalloy = "amy"\n',
        error=("repository.toml", None, "models.tts.voice_aliases.alloy", "not among voices"),
    ),
    Case(
        "alias-taken",
        stages={"asr": 'backend = "A"\nterminal = true'},
        repository=MODELS
        + 'aliases = ["x"]\n[models.asr]\nentry = "asr"\ntasks = ["transcription"]\n'
        'aliases = ["x"]\n',
        error=("repository.toml", None, "models.asr.aliases", "already names model 'tts'"),
    ),
    Case(
        "unreachable-stage",
        stages={"orphan": 'backend = "O"\nterminal = true\n'},
        error=("stage.toml", "orphan", None, "no served model reaches"),
    ),
    # -- TP --
    Case(
        "tp-gpu-count",
        stages={"encoder": gpu_stage("E", "gpu = [0, 1, 2]\ntp_size = 2\n")},
        error=("stage.toml", "encoder", "gpu", "3 GPU ids for tp_size = 2"),
    ),
    Case(
        "tp-stage-as-stream-target",
        stages={"encoder": ENCODER + "tp_size = 2\n"},  # SYNTH streams to it
        error=("stage.toml", "synth", "stream_to", "tensor-parallel"),
    ),
    Case(
        "tp-ranks-share-gpu",
        stages={"encoder": gpu_stage("E", "gpu = [1, 1]\ntp_size = 2\n")},
        error=("stage.toml", "encoder", "gpu", "TP ranks may not share a GPU"),
    ),
    Case(
        "tp-stage-shares-process",
        stages={
            "synth": 'backend = "Y"\nnext = "encoder"\nprocess = "encoder"\n',
            "encoder": gpu_stage("E", "gpu = [0, 1]\ntp_size = 2\n"),
        },
        error=("stage.toml", "synth", "process", "owns its process"),
    ),
    Case(
        "tp-replica-ranks-share-gpu",
        stages={
            "synth": PLAIN_SYNTH,
            "encoder": gpu_stage("E", "gpu = [0, 1]\ntp_size = 2\ngpu_memory_fraction = 0.4\n"),
        },
        repository=MODELS
        + "[processes.encoder]\nnum_replicas = 2\nreplica_devices = [0, 1, 2, 2]\n",
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
            "synth": 'backend = "Y"\nnext = "encoder"\nprocess_local = "encoder"\n',
            "encoder": gpu_stage("E", "gpu = [0, 1]\ntp_size = 2\n"),
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
            "frontend": FRONTEND + 'process = "p"\nprocess_local = "synth"\n',
            "synth": 'backend = "Y"\nnext = "encoder"\nprocess = "p"\n',
        },
        overrides=["--stages.synth.process", "q"],
        error=("stage.toml", "frontend", "process_local", "runs in process 'p'"),
    ),
    # -- replicas and placement --
    Case(
        "unknown-process",
        repository=MODELS + "[processes.ghost]\nnum_replicas = 2\n",
        error=("repository.toml", None, "processes.ghost", "no stage runs in process 'ghost'"),
    ),
    Case(
        "unknown-process-field",
        repository=MODELS + "[processes.synth]\ncopies = 2\n",
        error=("repository.toml", None, "processes.synth.copies", "num_replicas, replica_devices"),
    ),
    Case(
        "zero-replicas",
        repository=MODELS + "[processes.synth]\nnum_replicas = 0\n",
        error=("repository.toml", None, "processes.synth.num_replicas", ">= 1"),
    ),
    Case(
        "unknown-binding",
        repository=MODELS + '[processes.synth]\nnum_replicas = 2\nbinding = "random"\n',
        error=(
            "repository.toml",
            None,
            "processes.synth.binding",
            'expected one of "round_robin", "least_loaded", got "random"',
        ),
    ),
    Case(
        "binding-not-a-string",
        repository=MODELS + "[processes.synth]\nnum_replicas = 2\nbinding = 1\n",
        error=("repository.toml", None, "processes.synth.binding", '"least_loaded", got 1'),
    ),
    Case(
        "binding-override-unknown",
        repository=MODELS + "[processes.synth]\nnum_replicas = 2\n",
        overrides=["--processes.synth.binding", "fastest"],
        error=("command line", None, "processes.synth.binding", 'got "fastest"'),
    ),
    Case(
        "gpu-replicas-without-devices",
        stages={"encoder": gpu_stage("E", "gpu = 0\n")},
        repository=MODELS + "[processes.encoder]\nnum_replicas = 2\n",
        error=("repository.toml", None, "processes.encoder.replica_devices", "must say where"),
    ),
    Case(
        "replica-devices-length",
        stages={"encoder": gpu_stage("E", "gpu = 0\ngpu_memory_fraction = 0.2\n")},
        repository=MODELS + "[processes.encoder]\nnum_replicas = 2\nreplica_devices = [1, 2, 3]\n",
        error=("repository.toml", None, "processes.encoder.replica_devices", "give exactly 2"),
    ),
    Case(
        "replica-devices-n-times-t",
        stages={
            "synth": PLAIN_SYNTH,
            "encoder": gpu_stage("E", "gpu = [0, 1]\ntp_size = 2\ngpu_memory_fraction = 0.2\n"),
        },
        repository=MODELS + "[processes.encoder]\nnum_replicas = 2\nreplica_devices = [1, 2]\n",
        error=(
            "repository.toml",
            None,
            "processes.encoder.replica_devices",
            "x tp_size 2; give exactly 4",
        ),
    ),
    Case(
        "replica-devices-on-cpu-process",
        repository=MODELS + "[processes.synth]\nreplica_devices = [0]\n",
        error=("repository.toml", None, "processes.synth.replica_devices", "only CPU stages"),
    ),
    # -- memory fractions --
    Case(
        "replicas-one-gpu-without-fraction",
        stages={"encoder": gpu_stage("E", "gpu = 0\n")},
        repository=MODELS + "[processes.encoder]\nnum_replicas = 2\nreplica_devices = [0, 0]\n",
        error=("stage.toml", "encoder", "gpu_memory_fraction", "replica_devices"),
    ),
    Case(
        "replica-devices-one-replica-needs-fraction",
        stages={"encoder": gpu_stage("E", "gpu = 0\n")},
        repository=MODELS + "[processes.encoder]\nreplica_devices = [3]\n",
        error=("stage.toml", "encoder", "gpu_memory_fraction", "never inferred"),
    ),
    Case(
        "processes-share-gpu-without-fraction",
        stages={
            "synth": 'backend = "Y"\nnext = "encoder"\ngpu = 0\ngpu_memory_fraction = 0.5\n',
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
        stages={"encoder": gpu_stage("E", "gpu = 0\ngpu_memory_fraction = 0.6\n")},
        repository=MODELS + "[processes.encoder]\nnum_replicas = 2\nreplica_devices = [0, 0]\n",
        error=(
            "stage.toml",
            "encoder",
            "gpu_memory_fraction",
            "GPU 0 is over budget: declared fractions sum to 1.2",
        ),
    ),
    Case(
        "fractions-over-lowered-limit",
        stages={"encoder": gpu_stage("E", "gpu = 0\ngpu_memory_fraction = 0.5\n")},
        repository=MODELS
        + "[server]\ngpu_memory_limit = 0.9\n[processes.encoder]\nnum_replicas = 2\n"
        "replica_devices = [0, 0]\n",
        error=("stage.toml", "encoder", "gpu_memory_fraction", "gpu_memory_limit 0.9"),
    ),
    # -- weight sharing --
    Case(
        "weight-share-without-engine",
        stages={"encoder": gpu_stage("E", "gpu = 0\ngpu_memory_fraction = 0.4\n")},
        repository=MODELS + '[server]\nweight_share = "on"\n[processes.encoder]\nnum_replicas = 2\n'
        "replica_devices = [0, 0]\n",
        error=("repository.toml", None, "server.weight_share", "exactly one engine stage"),
    ),
    Case(
        "weight-share-two-engines",
        stages={
            "synth": 'backend = "Y"\nnext = "encoder"\nprocess = "p"\ngpu = 0\n'
            "gpu_memory_fraction = 0.1\n"
            "[engine]\nmax_total_tokens = 1\n",
            "encoder": gpu_stage(
                "E",
                'process = "p"\ngpu = 0\ngpu_memory_fraction = 0.3\n[engine]\n'
                "max_total_tokens = 1\n",
            ),
        },
        repository=MODELS + '[server]\nweight_share = "on"\n[processes.p]\nnum_replicas = 2\n'
        "replica_devices = [0, 0]\n",
        error=("repository.toml", None, "server.weight_share", "it has 2: synth, encoder"),
    ),
    Case(
        "weight-share-unpinned-budget",
        stages={
            "encoder": gpu_stage("E", "gpu = 0\ngpu_memory_fraction = 0.4\n[engine]\n"),
        },
        repository=MODELS + '[server]\nweight_share = "on"\n[processes.encoder]\nnum_replicas = 2\n'
        "replica_devices = [0, 0]\n",
        error=("stage.toml", "encoder", "engine.max_total_tokens", "pinned KV budget"),
    ),
    Case(
        "weight-share-tp-engine",
        stages={
            "synth": PLAIN_SYNTH,
            "encoder": gpu_stage(
                "E",
                "gpu = [0, 1]\ntp_size = 2\ngpu_memory_fraction = 0.4\n[engine]\n"
                "max_total_tokens = 9\n",
            ),
        },
        repository=MODELS + '[server]\nweight_share = "on"\n[processes.encoder]\nnum_replicas = 2\n'
        "replica_devices = [0, 1, 0, 1]\n",
        error=("stage.toml", "encoder", "tp_size", "tp_size = 1"),
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
        ("[processes.synth]\nnum_replicas = 2\n", [], "round_robin"),  # the default
        ('[processes.synth]\nnum_replicas = 2\nbinding = "least_loaded"\n', [], "least_loaded"),
        (
            '[processes.synth]\nnum_replicas = 2\nbinding = "least_loaded"\n',
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
