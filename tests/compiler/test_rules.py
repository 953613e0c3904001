"""Every compiler rule, table-driven: each rule has accepted and rejected repositories.

A case starts from a small valid 3-stage TTS repository (frontend -> synth ~> encoder) and
changes stage descriptors, repository.toml or overrides, one line of TOML each (" | " ends a
line; "+" stands for the base's own text). A rejected case names the file, stage and field the
error must name, and a fragment of the explanation: "FILE STAGE FIELD: fragment".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from omni_server.compiler.compiler import compile_repository
from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.plan import NO_SAMPLING, SamplingSpec
from omni_server.compiler.render import config_dict
from tests.helpers.repo import make_repo

# A case writes TOML on one line: " | " ends a line (`t`). The base repository:
FRONTEND = 'backend = "Frontend" | next = "synth"'
SYNTH = (
    'backend = "Synth" | next = "encoder" | stream_to = "encoder" | [scheduler] | kind = "stream"'
)
ENCODER = 'backend = "Encoder" | terminal = true'
MODELS = '[models.tts] | entry = "frontend" | tasks = ["speech"] | voices = ["joe"]'
BASE = {"frontend": FRONTEND, "synth": SYNTH, "encoder": ENCODER}
# for cases where the encoder is tensor-parallel: a TP stage cannot be a stream target
PLAIN_SYNTH = 'backend = "Synth" | next = "encoder"'
SYNTH_TERMINAL = (
    'backend = "Synth" | terminal = true | stream_to = "encoder" | [scheduler] | kind = "stream"'
)
ENDS_AT_SYNTH = MODELS + ' | stages = ["frontend", "synth"]'

Stages = dict[str, str | None]
Args = tuple[str, ...] | list[str]


@dataclass
class Case:
    id: str
    stages: Stages = field(default_factory=dict)  # replaces / adds; None deletes
    repository: str = "+"  # "+": MODELS
    overrides: list[str] = field(default_factory=list)
    # rejected cases: (file name, stage, field, fragment of the message)
    error: tuple[str, str | None, str | None, str] | None = None


def _expand(text: str, base: str) -> str:
    """A case's one-line TOML as file text; a leading "+" stands for `base`."""
    if text.startswith("+"):
        text = base + text[1:]
    return t(text) if text else ""


def build(tmp_path: Path, case: Case) -> Path:
    stages: Stages = {**BASE, **case.stages}
    return make_repo(
        tmp_path / "repo",
        stages={k: _expand(v, BASE.get(k, "")) for k, v in stages.items() if v is not None},
        repository=_expand(case.repository, MODELS),
    )


def t(text: str) -> str:
    """TOML from a case's one-line form: " | " ends a line."""
    return "".join(line + "\n" for line in text.split(" | "))


def ok(
    id: str,
    *,
    stages: Stages | None = None,
    repo: str = "+",
    args: Args = (),
    **named: str | None,
) -> Case:
    """A repository the compiler accepts. A stage's text replaces the base repository's (None
    deletes it; "+ | ..." is the base's own text and more lines); `repo` is repository.toml
    ("+ | ..." is MODELS and more lines); `args` are command-line overrides."""
    return Case(id, {**(stages or {}), **named}, repo, list(args))


def bad(
    id: str,
    error: str,
    *,
    stages: Stages | None = None,
    repo: str = "+",
    args: Args = (),
    **named: str | None,
) -> Case:
    """A repository the compiler rejects; `error` is "FILE STAGE FIELD: fragment of the
    message" ("-": no stage, no field), the rest as in `ok`."""
    where, fragment = error.split(": ", 1)
    file_name, stage, field_name = where.rsplit(" ", 2)  # a file name may hold a space
    return Case(
        id,
        {**(stages or {}), **named},
        repo,
        list(args),
        (file_name, _named(stage), _named(field_name), fragment),
    )


def _named(part: str) -> str | None:
    return None if part == "-" else part


ACCEPTED = [
    ok("base"),
    ok(
        "stream-to-only-successor",
        synth='backend = "Synth" | stream_to = "encoder" | [scheduler] | kind = "stream"',
    ),
    ok(
        "model-stages-end-at-a-shared-terminal",
        synth=SYNTH_TERMINAL,
        repo=ENDS_AT_SYNTH + ' | [models.spoken] | entry = "frontend" | tasks = ["speech"]',
    ),
    ok("backend-class-only-defaults-to-model-py"),
    ok(
        "backend-file-and-class",
        encoder='backend = "model.py:Encoder" | terminal = true',
    ),
    ok(
        "route-among-next",
        frontend='backend = "F" | next = ["synth", "encoder"] | route = "choose"',
    ),
    ok(
        "fan-in-with-merge",
        frontend='backend = "F" | next = ["synth", "side"]',
        side='backend = "S" | next = "join"',
        synth='backend = "Y" | next = "join"',
        join='backend = "J" | wait_for = ["synth", "side"] | merge = "merge" | next = "encoder"',
    ),
    ok(
        "batch-scheduler",
        encoder=(
            'backend = "E" | terminal = true | [scheduler] | kind = "batch" | max_batch_size = 8 | '
            "max_queue_delay_ms = 5"
        ),
    ),
    ok("engine-on-cpu", encoder="+ | [engine] | max_total_tokens = 4096"),
    ok(
        "sampling-defaults",
        frontend=(
            "+ | [sampling] | temperature = 0 | top_p = 1 | top_k = 40 | min_p = 0.05 | "
            "max_tokens = 64"
        ),
    ),
    ok(
        "parameters-free-form",
        encoder=(
            '+ | [parameters] | voice = "joe" | rate = 22050 | [parameters.nested] | x = [1, 2]'
        ),
    ),
    ok(
        "grouped-process",
        frontend='+ | process = "pipeline" | process_local = "synth"',
        synth=PLAIN_SYNTH
        + ' | stream_to = "encoder" | process = "pipeline" | [scheduler] | kind = "stream"',
    ),
    ok("tp-on-cpu-ranks", synth=PLAIN_SYNTH, encoder="+ | tp_size = 2"),
    ok(
        "tp-stage-owns-process",
        synth=PLAIN_SYNTH,
        encoder='backend = "E" | terminal = true | gpu = [0, 1] | tp_size = 2',
    ),
    ok("cpu-replicas-need-no-devices", repo="+ | [processes.synth] | num_replicas = 3"),
    ok(
        "least-loaded-binding",
        repo='+ | [processes.synth] | num_replicas = 2 | binding = "least_loaded"',
    ),
    ok(
        "round-robin-binding",
        repo='+ | [processes.synth] | num_replicas = 2 | binding = "round_robin"',
    ),
    ok(
        "binding-of-one-replica-is-harmless",
        repo='+ | [processes.synth] | binding = "least_loaded"',
    ),
    ok(
        "binding-by-override",
        repo="+ | [processes.synth] | num_replicas = 2",
        args=["--processes.synth.binding", "least_loaded"],
    ),
    ok(
        "gpu-replicas-on-two-gpus",
        encoder='backend = "E" | terminal = true | gpu = 0 | gpu_memory_fraction = 0.5',
        repo="+ | [processes.encoder] | num_replicas = 2 | replica_devices = [1, 2]",
    ),
    ok(
        "two-replicas-one-gpu-with-fractions",
        encoder='backend = "E" | terminal = true | gpu = 0 | gpu_memory_fraction = 0.5',
        repo="+ | [processes.encoder] | num_replicas = 2 | replica_devices = [0, 0]",
    ),
    ok(
        "tp-replicas-n-times-t",
        synth=PLAIN_SYNTH,
        encoder=(
            'backend = "E" | terminal = true | gpu = [0, 1] | tp_size = 2 | '
            "gpu_memory_fraction = 0.4"
        ),
        repo="+ | [processes.encoder] | num_replicas = 2 | replica_devices = [0, 1, 2, 3]",
    ),
    ok(
        "processes-sharing-a-gpu-with-fractions",
        synth='backend = "Y" | next = "encoder" | gpu = 0 | gpu_memory_fraction = 0.6',
        encoder='backend = "E" | terminal = true | gpu = 0 | gpu_memory_fraction = 0.4',
    ),
    ok(
        "one-gpu-one-process-needs-no-fraction",
        synth='backend = "Y" | next = "encoder" | gpu = 0 | process = "p"',
        encoder='backend = "E" | terminal = true | gpu = 0 | process = "p"',
    ),
    ok(
        "fractions-fit-a-lowered-limit",
        encoder='backend = "E" | terminal = true | gpu = 0 | gpu_memory_fraction = 0.4',
        repo=(
            "+ | [server] | gpu_memory_limit = 0.9 | [processes.encoder] | num_replicas = 2 | "
            "replica_devices = [0, 0]"
        ),
    ),
    ok(
        "weight-share-one-pinned-engine",
        encoder=(
            'backend = "E" | terminal = true | gpu = 0 | gpu_memory_fraction = 0.4 | [engine] | '
            "max_total_tokens = 30000"
        ),
        repo=(
            '+ | [server] | weight_share = "on" | mps = "on" | [processes.encoder] | '
            "num_replicas = 2 | replica_devices = [0, 0]"
        ),
    ),
    ok("weight-share-without-sharing-group", repo='+ | [server] | weight_share = "on"'),
    ok("mps-auto", repo='+ | [server] | mps = "auto"'),
    ok(
        "model-voices-and-aliases",
        repo=(
            '[models.tts] | entry = "frontend" | tasks = ["speech", "realtime"] | '
            'aliases = ["tts-1"] | voices = ["joe", "amy"] | default_voice = "joe" | '
            'description = "x" | [models.tts.voice_aliases] | alloy = "joe"'
        ),
    ),
    ok(
        "two-models-two-entries",
        asr='backend = "A" | terminal = true',
        repo='+ | [models.asr] | entry = "asr" | tasks = ["transcription"]',
    ),
    ok(
        "route-stage-streams",
        synth=(
            'backend = "Y" | next = ["encoder"] | route = "pick" | stream_to = ["encoder"] | '
            '[scheduler] | kind = "stream"'
        ),
    ),
    # stream-only-target: the encoder gets chunks only; frontend's result goes to synth
    ok(
        "stream-only-target",
        frontend=(
            'backend = "F" | next = "synth" | stream_to = "encoder" | [scheduler] | kind = "stream"'
        ),
        synth='backend = "Y" | terminal = true',
    ),
    # stream-into-an-ar-stage: its steps take the chunks (take_stream): the Higgs vocoder
    ok("stream-into-an-ar-stage", encoder='+ | [scheduler] | kind = "ar"'),
    ok(
        "terminal-stage-streams",
        synth=(
            'backend = "Y" | terminal = true | stream_to = "encoder" | [scheduler] | '
            'kind = "stream"'
        ),
    ),
    ok(
        "hidden-folder-is-no-stage",
        stages={".backup": 'backend = "B" | terminal = true'},
    ),
    ok(
        "override-regroups",
        args=[
            "--stages.frontend.process",
            "pipeline",
            "--stages.synth.process",
            "pipeline",
        ],
    ),
]

REJECTED = [
    bad(
        "model-stages-unknown",
        "repository.toml - models.tts.stages: no stage 'ghost'",
        repo='+ | stages = ["frontend", "ghost"]',
    ),
    bad(
        "model-stages-without-entry",
        "repository.toml - models.tts.stages: entry 'frontend' must be among",
        repo='+ | stages = ["synth", "encoder"]',
    ),
    bad(
        "model-stages-dead-end",
        "repository.toml - models.tts.stages: 'synth' is not terminal",
        repo=ENDS_AT_SYNTH,
    ),
    bad(
        "model-stages-unreachable",
        "repository.toml - models.tts.stages: does not reach encoder",
        repo='+ | stages = ["frontend", "encoder"]',
    ),
    # -- files and fields --
    bad(
        "unknown-stage-field",
        "stage.toml encoder colour: valid fields: backend, process",
        encoder="+ | colour = 1",
    ),
    bad(
        "wrong-type",
        "stage.toml encoder tp_size: expected an integer",
        encoder='+ | tp_size = "2"',
    ),
    bad(
        "bool-is-not-int",
        "stage.toml encoder tp_size: expected an integer",
        encoder="+ | tp_size = true",
    ),
    bad(
        "unknown-scheduler-field",
        "stage.toml encoder scheduler.size: valid fields: kind",
        encoder="+ | [scheduler] | size = 2",
    ),
    bad(
        "bad-scheduler-kind",
        'stage.toml encoder scheduler.kind: "single", "batch", "stream"',
        encoder='+ | [scheduler] | kind = "fast"',
    ),
    bad(
        "batch-size-without-batch",
        'stage.toml encoder scheduler.max_batch_size: kind = "batch"',
        encoder="+ | [scheduler] | max_batch_size = 4",
    ),
    bad("bad-toml", "stage.toml - -: not valid TOML", encoder="backend = "),
    bad(
        "missing-backend",
        "stage.toml encoder backend: required",
        encoder="terminal = true",
    ),
    bad(
        "backend-file-missing",
        "stage.toml encoder backend: no file 'other.py'",
        encoder='backend = "other.py:E" | terminal = true',
    ),
    bad(
        "backend-outside-folder",
        "stage.toml encoder backend: outside the stage folder",
        encoder='backend = "../synth/model.py:E" | terminal = true',
    ),
    bad(
        "backend-bad-form",
        'stage.toml encoder backend: "file.py:ClassName"',
        encoder='backend = "model.py:" | terminal = true',
    ),
    bad(
        "unknown-repository-table",
        "repository.toml - extra: valid tables: server, models, processes",
        repo="+ | [extra] | x = 1",
    ),
    bad(
        "unknown-server-field",
        "repository.toml - server.threads: valid fields: mps",
        repo="+ | [server] | threads = 2",
    ),
    bad(
        "bad-mps",
        'repository.toml - server.mps: "off", "auto", "on"',
        repo='+ | [server] | mps = "yes"',
    ),
    bad(
        "limit-out-of-range",
        "repository.toml - server.gpu_memory_limit: (0, 1]",
        repo="+ | [server] | gpu_memory_limit = 1.5",
    ),
    bad(
        "fraction-out-of-range",
        "stage.toml encoder gpu_memory_fraction: (0, 1]",
        encoder='backend = "E" | terminal = true | gpu = 0 | gpu_memory_fraction = 0',
    ),
    bad(
        "negative-gpu",
        "stage.toml encoder gpu: integer",
        encoder='backend = "E" | terminal = true | gpu = -1',
    ),
    bad(
        "empty-gpu-list",
        "stage.toml encoder gpu: names no GPU",
        encoder='backend = "E" | terminal = true | gpu = []',
    ),
    bad(
        "fraction-on-cpu-stage",
        "stage.toml encoder gpu_memory_fraction: CPU stage",
        encoder='backend = "E" | terminal = true | gpu_memory_fraction = 0.5',
    ),
    bad(
        "bad-process-name",
        "stage.toml encoder process: letters, digits",
        encoder='+ | process = "a.b"',
    ),
    # -- routing --
    bad(
        "next-and-terminal",
        "stage.toml encoder terminal: terminal = true or next",
        encoder='+ | next = "synth"',
    ),
    bad("no-routing", "stage.toml encoder next: no routing", encoder='backend = "E"'),
    bad(
        "route-without-next",
        "stage.toml encoder route: declare next",
        encoder='+ | route = "pick"',
    ),
    bad(
        "route-not-a-method-name",
        "stage.toml frontend route: not a method name",
        frontend='+ | route = "a-b"',
    ),
    bad(
        "next-target-missing",
        "stage.toml frontend next: no stage 'ghost'",
        frontend='backend = "F" | next = ["synth", "ghost"]',
    ),
    bad(
        "next-listed-twice",
        "stage.toml frontend next: listed twice",
        frontend='backend = "F" | next = ["synth", "synth"]',
    ),
    bad(
        "stream-target-missing",
        "stage.toml synth stream_to: no stage 'ghost'",
        synth=PLAIN_SYNTH + ' | stream_to = ["encoder", "ghost"] | [scheduler] | kind = "stream"',
    ),
    bad(
        "stream-from-non-stream-stage",
        'stage.toml synth stream_to: kind = "stream"',
        synth='backend = "Y" | next = "encoder" | stream_to = "encoder"',
    ),
    bad(
        "self-loop",
        "stage.toml frontend next: cannot name itself",
        frontend='backend = "F" | next = ["synth", "frontend"]',
    ),
    bad(
        "cycle",
        "stage.toml frontend next: cycle: frontend -> synth -> frontend",
        synth='backend = "Y" | next = ["encoder", "frontend"]',
        start='backend = "S" | next = "frontend"',
        repo='[models.tts] | entry = "start" | tasks = ["speech"] | voices = ["joe"]',
    ),
    bad(
        "stream-cycle",
        "stage.toml encoder stream_to: cycle: encoder -> synth -> encoder",
        encoder=(
            'backend = "E" | terminal = true | stream_to = "synth" | [scheduler] | kind = "stream"'
        ),
    ),
    # -- fan-in --
    bad(
        "wait-for-without-merge",
        "stage.toml synth merge: wait_for needs merge",
        frontend='backend = "F" | next = ["synth"]',
        synth='backend = "Y" | next = "encoder" | wait_for = ["frontend"]',
    ),
    bad(
        "merge-without-wait-for",
        "stage.toml encoder merge: declare wait_for",
        encoder='+ | merge = "m"',
    ),
    bad(
        "wait-for-missing-stage",
        "stage.toml synth wait_for: no stage 'ghost'",
        synth='backend = "Y" | next = "encoder" | wait_for = ["frontend", "ghost"] | merge = "m"',
    ),
    bad(
        "wait-for-stage-not-feeding",
        "stage.toml synth wait_for: 'side' never hands data to 'synth'",
        frontend='backend = "F" | next = ["synth", "side"]',
        side='backend = "S" | terminal = true',
        synth='backend = "Y" | next = "encoder" | wait_for = ["frontend", "side"] | merge = "m"',
    ),
    bad(
        "sender-not-waited-for",
        "stage.toml frontend next: waits for ['synth', 'side'] only",
        frontend='backend = "F" | next = ["synth", "side", "join"]',
        side='backend = "S" | next = "join"',
        synth='backend = "Y" | next = "join"',
        join='backend = "J" | wait_for = ["synth", "side"] | merge = "m" | next = "encoder"',
    ),
    # -- models --
    bad("no-models", "repository.toml - models: at least one", repo=""),
    bad(
        "entry-missing",
        "repository.toml - models.tts.entry: no stage 'ghost'",
        repo='[models.tts] | entry = "ghost" | tasks = ["speech"] | voices = ["joe"]',
    ),
    bad(
        "entry-required",
        "repository.toml - models.tts.entry: required",
        repo='[models.tts] | tasks = ["speech"]',
    ),
    bad(
        "entry-is-fan-in",
        "stage.toml frontend wait_for: never hands data",
        frontend='backend = "F" | next = "synth" | wait_for = ["encoder"] | merge = "m"',
    ),
    bad(
        "bad-task",
        "repository.toml - models.tts.tasks: speech, transcription, chat, realtime",
        repo='[models.tts] | entry = "frontend" | tasks = ["dance"] | voices = ["joe"]',
    ),
    bad(
        "default-voice-unknown",
        "repository.toml - models.tts.default_voice: not among voices",
        repo='+ | default_voice = "amy"',
    ),
    bad(
        "voice-alias-unknown-target",
        "repository.toml - models.tts.voice_aliases.alloy: not among voices",
        repo='+ | [models.tts.voice_aliases] | alloy = "amy"',
    ),
    bad(
        "alias-taken",
        "repository.toml - models.asr.aliases: already names model 'tts'",
        asr='backend = "A" | terminal = true',
        repo=(
            '+ | aliases = ["x"] | [models.asr] | entry = "asr" | tasks = ["transcription"] | '
            'aliases = ["x"]'
        ),
    ),
    bad(
        "unreachable-stage",
        "stage.toml orphan -: no served model reaches",
        orphan='backend = "O" | terminal = true',
    ),
    # -- TP --
    bad(
        "tp-gpu-count",
        "stage.toml encoder gpu: 3 GPU ids for tp_size = 2",
        encoder='backend = "E" | terminal = true | gpu = [0, 1, 2] | tp_size = 2',
    ),
    bad(
        "tp-stage-as-stream-target",
        "stage.toml synth stream_to: tensor-parallel",
        encoder="+ | tp_size = 2",
    ),
    bad(
        "tp-ranks-share-gpu",
        "stage.toml encoder gpu: TP ranks may not share a GPU",
        encoder='backend = "E" | terminal = true | gpu = [1, 1] | tp_size = 2',
    ),
    bad(
        "tp-stage-shares-process",
        "stage.toml synth process: owns its process",
        synth='backend = "Y" | next = "encoder" | process = "encoder"',
        encoder='backend = "E" | terminal = true | gpu = [0, 1] | tp_size = 2',
    ),
    bad(
        "tp-replica-ranks-share-gpu",
        "repository.toml - processes.encoder.replica_devices: distinct GPUs",
        synth=PLAIN_SYNTH,
        encoder=(
            'backend = "E" | terminal = true | gpu = [0, 1] | tp_size = 2 | '
            "gpu_memory_fraction = 0.4"
        ),
        repo="+ | [processes.encoder] | num_replicas = 2 | replica_devices = [0, 1, 2, 2]",
    ),
    # -- process-local edges --
    bad(
        "process-local-across-processes",
        "stage.toml frontend process_local: edge frontend -> synth would cross",
        frontend='+ | process_local = "synth"',
    ),
    bad(
        "process-local-across-tp",
        "stage.toml synth process_local: 'encoder' is a TP stage",
        synth='backend = "Y" | next = "encoder" | process_local = "encoder"',
        encoder='backend = "E" | terminal = true | gpu = [0, 1] | tp_size = 2',
    ),
    bad(
        "process-local-not-a-successor",
        "stage.toml frontend process_local: not a successor",
        frontend='+ | process_local = "encoder"',
    ),
    bad(
        "process-local-split-by-override",
        "stage.toml frontend process_local: runs in process 'p'",
        frontend='+ | process = "p" | process_local = "synth"',
        synth='backend = "Y" | next = "encoder" | process = "p"',
        args=["--stages.synth.process", "q"],
    ),
    # -- replicas and placement --
    bad(
        "unknown-process",
        "repository.toml - processes.ghost: no stage runs in process 'ghost'",
        repo="+ | [processes.ghost] | num_replicas = 2",
    ),
    bad(
        "unknown-process-field",
        "repository.toml - processes.synth.copies: num_replicas, replica_devices",
        repo="+ | [processes.synth] | copies = 2",
    ),
    bad(
        "zero-replicas",
        "repository.toml - processes.synth.num_replicas: >= 1",
        repo="+ | [processes.synth] | num_replicas = 0",
    ),
    bad(
        "unknown-binding",
        (
            "repository.toml - processes.synth.binding: "
            'expected one of "round_robin", "least_loaded", got "random"'
        ),
        repo='+ | [processes.synth] | num_replicas = 2 | binding = "random"',
    ),
    bad(
        "binding-not-a-string",
        'repository.toml - processes.synth.binding: "least_loaded", got 1',
        repo="+ | [processes.synth] | num_replicas = 2 | binding = 1",
    ),
    bad(
        "binding-override-unknown",
        'command line - processes.synth.binding: got "fastest"',
        repo="+ | [processes.synth] | num_replicas = 2",
        args=["--processes.synth.binding", "fastest"],
    ),
    bad(
        "gpu-replicas-without-devices",
        "repository.toml - processes.encoder.replica_devices: must say where",
        encoder='backend = "E" | terminal = true | gpu = 0',
        repo="+ | [processes.encoder] | num_replicas = 2",
    ),
    bad(
        "replica-devices-length",
        "repository.toml - processes.encoder.replica_devices: give exactly 2",
        encoder='backend = "E" | terminal = true | gpu = 0 | gpu_memory_fraction = 0.2',
        repo="+ | [processes.encoder] | num_replicas = 2 | replica_devices = [1, 2, 3]",
    ),
    bad(
        "replica-devices-n-times-t",
        "repository.toml - processes.encoder.replica_devices: x tp_size 2; give exactly 4",
        synth=PLAIN_SYNTH,
        encoder=(
            'backend = "E" | terminal = true | gpu = [0, 1] | tp_size = 2 | '
            "gpu_memory_fraction = 0.2"
        ),
        repo="+ | [processes.encoder] | num_replicas = 2 | replica_devices = [1, 2]",
    ),
    bad(
        "replica-devices-on-cpu-process",
        "repository.toml - processes.synth.replica_devices: only CPU stages",
        repo="+ | [processes.synth] | replica_devices = [0]",
    ),
    # -- memory fractions --
    bad(
        "replicas-one-gpu-without-fraction",
        "stage.toml encoder gpu_memory_fraction: replica_devices",
        encoder='backend = "E" | terminal = true | gpu = 0',
        repo="+ | [processes.encoder] | num_replicas = 2 | replica_devices = [0, 0]",
    ),
    bad(
        "replica-devices-one-replica-needs-fraction",
        "stage.toml encoder gpu_memory_fraction: never inferred",
        encoder='backend = "E" | terminal = true | gpu = 0',
        repo="+ | [processes.encoder] | replica_devices = [3]",
    ),
    bad(
        "processes-share-gpu-without-fraction",
        "stage.toml encoder gpu_memory_fraction: GPU 0 is shared by encoder@r0, synth@r0",
        synth='backend = "Y" | next = "encoder" | gpu = 0 | gpu_memory_fraction = 0.5',
        encoder='backend = "E" | terminal = true | gpu = 0',
    ),
    bad(
        "fractions-over-budget",
        (
            "stage.toml encoder gpu_memory_fraction: "
            "GPU 0 is over budget: declared fractions sum to 1.2"
        ),
        encoder='backend = "E" | terminal = true | gpu = 0 | gpu_memory_fraction = 0.6',
        repo="+ | [processes.encoder] | num_replicas = 2 | replica_devices = [0, 0]",
    ),
    bad(
        "fractions-over-lowered-limit",
        "stage.toml encoder gpu_memory_fraction: gpu_memory_limit 0.9",
        encoder='backend = "E" | terminal = true | gpu = 0 | gpu_memory_fraction = 0.5',
        repo=(
            "+ | [server] | gpu_memory_limit = 0.9 | [processes.encoder] | num_replicas = 2 | "
            "replica_devices = [0, 0]"
        ),
    ),
    # -- weight sharing --
    bad(
        "weight-share-without-engine",
        "repository.toml - server.weight_share: exactly one engine stage",
        encoder='backend = "E" | terminal = true | gpu = 0 | gpu_memory_fraction = 0.4',
        repo=(
            '+ | [server] | weight_share = "on" | [processes.encoder] | num_replicas = 2 | '
            "replica_devices = [0, 0]"
        ),
    ),
    bad(
        "weight-share-two-engines",
        "repository.toml - server.weight_share: it has 2: synth, encoder",
        synth=(
            'backend = "Y" | next = "encoder" | process = "p" | gpu = 0 | '
            "gpu_memory_fraction = 0.1 | [engine] | max_total_tokens = 1"
        ),
        encoder=(
            'backend = "E" | terminal = true | process = "p" | gpu = 0 | '
            "gpu_memory_fraction = 0.3 | [engine] | max_total_tokens = 1"
        ),
        repo=(
            '+ | [server] | weight_share = "on" | [processes.p] | num_replicas = 2 | '
            "replica_devices = [0, 0]"
        ),
    ),
    bad(
        "weight-share-unpinned-budget",
        "stage.toml encoder engine.max_total_tokens: pinned KV budget",
        encoder='backend = "E" | terminal = true | gpu = 0 | gpu_memory_fraction = 0.4 | [engine]',
        repo=(
            '+ | [server] | weight_share = "on" | [processes.encoder] | num_replicas = 2 | '
            "replica_devices = [0, 0]"
        ),
    ),
    bad(
        "weight-share-tp-engine",
        "stage.toml encoder tp_size: tp_size = 1",
        synth=PLAIN_SYNTH,
        encoder=(
            'backend = "E" | terminal = true | gpu = [0, 1] | tp_size = 2 | '
            "gpu_memory_fraction = 0.4 | [engine] | max_total_tokens = 9"
        ),
        repo=(
            '+ | [server] | weight_share = "on" | [processes.encoder] | num_replicas = 2 | '
            "replica_devices = [0, 1, 0, 1]"
        ),
    ),
    bad(
        "sampling-temperature-above-2",
        "stage.toml frontend sampling.temperature: a number in [0, 2], got 2.5",
        frontend="+ | [sampling] | temperature = 2.5",
    ),
    bad(
        "sampling-top-p-zero",
        "stage.toml frontend sampling.top_p: a number in (0, 1]",
        frontend="+ | [sampling] | top_p = 0",
    ),
    bad(
        "sampling-max-tokens-zero",
        "stage.toml frontend sampling.max_tokens: an integer >= 1, got 0",
        frontend="+ | [sampling] | max_tokens = 0",
    ),
    bad(
        "sampling-min-p-text",
        "stage.toml frontend sampling.min_p: a number in [0, 1]",
        frontend='+ | [sampling] | min_p = "low"',
    ),
    bad(
        "sampling-repetition-penalty-unknown",
        "stage.toml frontend sampling.repetition_penalty: valid fields: temp",
        frontend="+ | [sampling] | repetition_penalty = 1.1",
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
        ("+ | [processes.synth] | num_replicas = 2", [], "round_robin"),  # the default
        (
            '+ | [processes.synth] | num_replicas = 2 | binding = "least_loaded"',
            [],
            "least_loaded",
        ),
        (
            '+ | [processes.synth] | num_replicas = 2 | binding = "least_loaded"',
            ["--processes.synth.binding", "round_robin"],
            "round_robin",
        ),
        ("+", ["--processes.synth.binding", "least_loaded"], "least_loaded"),
    ],
)
def test_binding_reaches_the_plan(
    tmp_path: Path, repository: str, overrides: list[str], expected: str
) -> None:
    plan = compile_repository(build(tmp_path, Case("x", repository=repository)), overrides)
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
    root = make_repo(tmp_path / "empty", stages={}, repository=t(MODELS))
    (root / "notes").mkdir()  # a folder without stage.toml is no stage
    with pytest.raises(RepositoryError, match="no stages: a stage is a sub-folder holding a"):
        compile_repository(root)


def test_stage_folder_name_must_fit_override_paths(tmp_path: Path) -> None:
    root = build(tmp_path, Case("x", stages={"tts.v2": ENCODER}))
    with pytest.raises(RepositoryError, match="letters, digits") as info:
        compile_repository(root)
    assert info.value.stage == "tts.v2"
