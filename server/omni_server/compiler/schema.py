"""Every field of `stage.toml` and `repository.toml`: its type, default and meaning.

This table is the single source for type checks of files and of command-line overrides
(`--stages.x.max_batch_size 8` is typed by the same `Field`), and for the field lists that
error messages offer. `check_fields` applies it to one table. Cross-field and cross-stage
rules live in the compiler (`compiler`, `graph`, `placement`).
"""

from __future__ import annotations

import functools
import json
import math
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.plan import BindingPolicy, DeviceRequest, MpsMode, SchedulerKind
from omni_server.engine_config import field_problem, table_fields


class Kind(StrEnum):
    STR = "a string"
    INT = "an integer"
    FLOAT = "a number"
    BOOL = "true or false"
    ENUM = "one of"  # completed by Field.choices
    STR_LIST = "a list of strings"
    INT_LIST = "a list of integers"
    NAMES = "a string or a list of strings"
    GPU = "an integer or a list of integers"
    TABLE = "a table"  # free-form ([parameters])
    STR_MAP = "a table of strings"  # [models.<id>.voice_aliases]


@dataclass(frozen=True)
class Field:
    name: str
    kind: Kind
    doc: str
    default: Any = None
    choices: tuple[str, ...] = ()
    minimum: float | None = None  # ints and numbers: smallest valid value
    maximum: float | None = None  # ints and numbers: largest valid value
    fraction: bool = False  # numbers: must lie in (0, 1]
    # the check, where another module declares the field ([engine]: engine_config.py), with
    # that module's message; None: this table's kind and range
    rule: Callable[[Any], str | None] | None = None

    @property
    def expected(self) -> str:
        """What a valid value looks like, for error messages."""
        if self.kind is Kind.ENUM:
            return "one of " + ", ".join(f'"{c}"' for c in self.choices)
        if self.fraction:
            return "a number in (0, 1]"
        if self.minimum is not None and self.maximum is not None:
            return f"{self.kind.value} in [{self.minimum:g}, {self.maximum:g}]"
        if self.minimum is not None:
            return f"{self.kind.value} >= {self.minimum:g}"
        return self.kind.value

    def check(self, value: Any) -> str | None:
        """None when `value` (as TOML gives it) is valid for this field, else what was wrong."""
        if self.rule is not None:
            return self.rule(value)
        ok = _TYPE_CHECKS[self.kind](value)
        if ok and self.kind is Kind.ENUM:
            ok = value in self.choices
        if ok and self.kind in (Kind.INT, Kind.FLOAT) and not _in_range(self, value):
            ok = False
        if ok and self.kind in (Kind.INT_LIST, Kind.GPU):
            values = value if isinstance(value, list) else [value]
            ok = all(v >= 0 for v in values)
        return None if ok else f"expected {self.expected}, got {_show(value)}"

    def parse(self, text: str) -> Any:
        """A command-line override's text as a value of this field's type (checked by check())."""
        kind = self.kind
        try:
            if kind is Kind.INT:
                return int(text)
            if kind is Kind.FLOAT:
                return float(text)
            if kind is Kind.BOOL:
                return {"true": True, "false": False}[text.lower()]
            if kind in (Kind.STR_LIST, Kind.NAMES):
                listed = kind is Kind.STR_LIST or "," in text or text.lstrip().startswith("[")
                return _list(text, str) if listed else text
            if kind is Kind.INT_LIST:
                return _list(text, int)
            if kind is Kind.GPU:
                return _list(text, int) if ("," in text or "[" in text) else int(text)
            if kind in (Kind.TABLE, Kind.STR_MAP):
                return json.loads(text)
        except (ValueError, KeyError, TypeError):
            return _Unparsed(text)
        return text  # STR, ENUM: checked by check()


class _Unparsed(str):
    """Override text that does not parse as the field's type; check() rejects it by name."""


def _list(text: str, item: type) -> list[Any]:
    text = text.strip()
    if text.startswith("["):
        values = json.loads(text)
        if not isinstance(values, list):
            raise ValueError(text)
        return [item(v) if item is int and isinstance(v, str) else v for v in values]
    return [item(v.strip()) for v in text.split(",") if v.strip()] if text else []


def parse_free(text: str) -> Any:
    """A free-form ([parameters]) override: a TOML value if it reads as one, else the string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _in_range(field: Field, value: float) -> bool:
    if not math.isfinite(value):
        return False
    if field.fraction:
        return 0.0 < value <= 1.0
    if field.maximum is not None and value > field.maximum:
        return False
    return field.minimum is None or value >= field.minimum


def _show(value: Any) -> str:
    if isinstance(value, _Unparsed):
        return f"'{value}'"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if not isinstance(value, str) else f'"{value}"'


_TYPE_CHECKS = {
    Kind.STR: lambda v: isinstance(v, str) and not isinstance(v, _Unparsed),
    Kind.INT: _is_int,
    Kind.FLOAT: lambda v: _is_int(v) or isinstance(v, float),
    Kind.BOOL: lambda v: isinstance(v, bool),
    Kind.ENUM: lambda v: isinstance(v, str),
    Kind.STR_LIST: lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    Kind.INT_LIST: lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
    Kind.NAMES: lambda v: (
        (isinstance(v, str) and not isinstance(v, _Unparsed))
        or (isinstance(v, list) and all(isinstance(x, str) for x in v))
    ),
    Kind.GPU: lambda v: _is_int(v) or (isinstance(v, list) and all(_is_int(x) for x in v)),
    Kind.TABLE: lambda v: isinstance(v, dict),
    Kind.STR_MAP: lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
}


def _fields(*fields: Field) -> Mapping[str, Field]:
    return {f.name: f for f in fields}


# ---- stage.toml ---------------------------------------------------------------------------

SCHEDULER_FIELDS = _fields(
    Field(
        "kind",
        Kind.ENUM,
        "how requests reach the backend: one at a time (execute([r])), dynamic batches "
        "(execute(batch)), per-request streams (generate(r) yields chunks), or continuous "
        "batching of an autoregressive model (add(r), step(), abort(r))",
        default=SchedulerKind.SINGLE,
        choices=tuple(SchedulerKind),
    ),
    Field("max_batch_size", Kind.INT, "largest batch (kind = batch)", default=1, minimum=1),
    Field(
        "max_queue_delay_ms",
        Kind.FLOAT,
        "how long a batch may wait to fill (kind = batch)",
        default=0.0,
        minimum=0,
    ),
    Field(
        "first_chunk_lane",
        Kind.BOOL,
        "a second compute thread for requests' first chunks, so a new request's first chunk "
        "starts beside the step in progress instead of behind it (kind = stream; the backend's "
        "generate() steps of different requests must be safe to run at once)",
        default=False,
    ),
)

_ENGINE_KINDS = {"int": Kind.INT, "bool": Kind.BOOL, "choice": Kind.ENUM}


def _engine_fields() -> Mapping[str, Field]:
    """[engine]: EngineConfig's table fields (engine_config.py, the one declaration): its kinds
    type command-line overrides, its checks and messages judge the values."""
    fields = []
    for f in table_fields():
        meta = f.metadata
        fields.append(
            Field(
                f.name,
                _ENGINE_KINDS[meta["kind"]],
                meta["doc"],
                choices=meta["choices"],
                minimum=meta["minimum"] if meta["kind"] == "int" else None,
                rule=functools.partial(field_problem, f.name),
            )
        )
    return _fields(*fields)


ENGINE_FIELDS = _engine_fields()

# A request's sampling defaults: what the stage that reads a chat request's sampling fields (a
# model's entry) gives a request that leaves one out, as vLLM applies a model's
# generation_config. The ranges are what the chat API accepts, so a default is a valid request.
SAMPLING_FIELDS = _fields(
    Field(
        "temperature",
        Kind.FLOAT,
        "default temperature (0 = greedy); absent: OpenAI's 1",
        minimum=0,
        maximum=2,
    ),
    Field("top_p", Kind.FLOAT, "default nucleus mass; absent: 1 (off)", fraction=True),
    Field("top_k", Kind.INT, "default top-k (0 = off); absent: 0", minimum=0),
    Field("min_p", Kind.FLOAT, "default min-p (0 = off); absent: 0", minimum=0, maximum=1),
    Field(
        "max_tokens",
        Kind.INT,
        "completion tokens of a request that sets no max_tokens; absent: up to the context",
        minimum=1,
    ),
)

STAGE_FIELDS = _fields(
    Field(
        "backend",
        Kind.STR,
        '"file.py:ClassName" (file relative to the stage folder) or "ClassName" (in model.py)',
    ),
    Field("process", Kind.STR, "logical process; stages naming one process share it", "<stage>"),
    Field(
        "device",
        Kind.ENUM,
        'where the stage runs: "gpu" (its gpu ids), "cpu", or "auto" (the GPU when the '
        "machine has one, else the CPU); absent: gpu decides",
        choices=tuple(DeviceRequest),
    ),
    Field("gpu", Kind.GPU, "GPU id, or one id per TP rank (device gpu/auto: 0..tp_size-1)"),
    Field(
        "tp_size",
        Kind.INT,
        "tensor-parallel size; with gpu, len(gpu) must equal it; without, CPU ranks (gloo)",
        default=1,
        minimum=1,
    ),
    Field(
        "gpu_memory_fraction",
        Kind.FLOAT,
        "share of each GPU this stage budgets; required when a GPU is shared",
        fraction=True,
    ),
    Field("next", Kind.NAMES, "static successors, or the route method's allowed targets", []),
    Field("route", Kind.STR, "backend method choosing among `next` per request"),
    Field("terminal", Kind.BOOL, "the stage ends the pipeline (its output is the answer)", False),
    Field("wait_for", Kind.STR_LIST, "fan-in: upstream stages whose outputs are merged", []),
    Field("merge", Kind.STR, "backend method merging the wait_for outputs; required with it"),
    Field("stream_to", Kind.NAMES, "stages receiving this stage's chunks, beside routing", []),
    Field("process_local", Kind.NAMES, "successors whose edge must stay in one process", []),
    Field(
        "voice_cloning",
        Kind.BOOL,
        "the stage speaks in voices cloned from a reference clip: POST /v1/audio/voices adds "
        "voices to the models visiting it, and their requests carry the clip (docs/voices.md)",
        False,
    ),
    Field(
        "scheduler",
        Kind.TABLE,
        "[scheduler] table: kind, max_batch_size, max_queue_delay_ms, first_chunk_lane",
    ),
    Field(
        "timeout_s",
        Kind.FLOAT,
        "longest a request may stay at this stage (504 timeout after); a backend call running "
        "longer gets its process restarted; 0 = no limit; absent = [server] stage_timeout_s",
        minimum=0,
    ),
    Field("engine", Kind.TABLE, "[engine] table: marks an engine stage; max_total_tokens"),
    Field(
        "sampling",
        Kind.TABLE,
        "[sampling] table: a request's defaults (temperature, top_p, top_k, min_p, max_tokens)",
    ),
    Field("parameters", Kind.TABLE, "[parameters]: free-form, handed to the backend", {}),
    Field(
        "on_gpu",
        Kind.TABLE,
        "[on_gpu] table: the stage's fields where it lands on a GPU (gpu_memory_fraction, "
        "process, [engine], [parameters], ...), over the file's and under the command line's",
    ),
)

# The fields [on_gpu] may change: where the stage lands is decided before it applies (not
# device, gpu, tp_size), and the wiring does not depend on the machine.
ON_GPU_STAGE_FIELDS: Mapping[str, Field] = {
    name: STAGE_FIELDS[name]
    for name in (
        "process",
        "gpu_memory_fraction",
        "timeout_s",
        "scheduler",
        "engine",
        "sampling",
        "parameters",
    )
}

# Sub-tables of a stage whose fields are known; [parameters] is free-form.
STAGE_TABLES: Mapping[str, Mapping[str, Field]] = {
    "scheduler": SCHEDULER_FIELDS,
    "engine": ENGINE_FIELDS,
    "sampling": SAMPLING_FIELDS,
}

# ---- repository.toml ----------------------------------------------------------------------

SERVER_FIELDS = _fields(
    Field("mps", Kind.ENUM, "CUDA MPS for processes sharing a GPU", MpsMode.OFF, tuple(MpsMode)),
    Field(
        "weight_share",
        Kind.ENUM,
        "replicas repeating a GPU alias one copy of the engine weights",
        "off",
        ("off", "on"),
    ),
    Field(
        "gpu_memory_limit",
        Kind.FLOAT,
        "per-GPU limit for the sum of declared gpu_memory_fraction values",
        default=1.0,
        fraction=True,
    ),
    Field(
        "stage_timeout_s",
        Kind.FLOAT,
        "timeout_s of every stage that sets none; 0 = no limit",
        default=0.0,
        minimum=0,
    ),
)

TASKS = ("speech", "transcription", "chat", "realtime")
# How a model takes audio in (chat's input_audio parts, realtime's spoken turns): "transcribe"
# hears it with the repository's transcription model and the entry reads text; "native" hands
# the clips to the entry as `contracts.AudioPart`s (an omni model's own audio encoder).
AUDIO_INPUTS = ("transcribe", "native")

MODEL_FIELDS = _fields(
    Field("entry", Kind.STR, "the entry stage of the model's pipeline"),
    Field("tasks", Kind.STR_LIST, "API tasks served: " + ", ".join(TASKS)),
    Field(
        "stages",
        Kind.STR_LIST,
        "the stages this model's requests visit (default: every stage the entry reaches); "
        "edges to other stages are not followed, so models can share stages",
        [],
    ),
    Field("aliases", Kind.STR_LIST, "other ids accepted in requests (e.g. tts-1)", []),
    Field("voices", Kind.STR_LIST, "voices the pipeline knows", []),
    Field("default_voice", Kind.STR, "voice used when a request names none; one of voices"),
    Field("description", Kind.STR, "free text shown in /v1/models", ""),
    Field("language", Kind.STR, "BCP 47 tag of the model's voices (/v1/audio/voices), e.g. en-US"),
    Field("voice_aliases", Kind.STR_MAP, "alias -> voice (targets must be in voices)", {}),
    Field(
        "audio_input",
        Kind.ENUM,
        "how the model hears chat's input_audio and realtime's spoken turns: transcribed by "
        "the repository's transcription model (transcribe) or as audio by its entry (native)",
        AUDIO_INPUTS[0],
        AUDIO_INPUTS,
    ),
)

PROCESS_FIELDS = _fields(
    Field("num_replicas", Kind.INT, "copies of the whole logical process", default=1, minimum=1),
    Field(
        "replica_devices",
        Kind.INT_LIST,
        "GPU per replica (N ids, N x T for TP size T); overrides its stages' gpu",
        [],
    ),
    Field(
        "binding",
        Kind.ENUM,
        "how admission picks a request's replica, kept for the request's life: in turn "
        "(round_robin) or the one with the fewest requests in flight (least_loaded)",
        BindingPolicy.ROUND_ROBIN,
        tuple(BindingPolicy),
    ),
)

# repository.toml's top-level tables: [server] holds SERVER_FIELDS; [models.<id>] and
# [processes.<name>] hold one table of MODEL_FIELDS / PROCESS_FIELDS per entry; [parameters] is
# free-form, handed to every stage's backend (`context.repository_parameters`); [on_gpu] below.
REPOSITORY_TABLES = ("server", "models", "processes", "parameters", "on_gpu")

# repository.toml's [on_gpu]: [on_gpu.server] and [on_gpu.processes.<name>], applied over the
# file's tables (under the command line) when some stage lands on a GPU: the process layout
# and MPS a repository wants there.
ON_GPU_REPOSITORY_TABLES = ("server", "processes")


def field_value(data: Mapping[str, Any], fields: Mapping[str, Field], name: str) -> Any:
    """The table's value of field `name`, or the default the field declares (the one source)."""
    return data.get(name, fields[name].default)


def check_fields(
    data: Any,
    fields: Mapping[str, Field],
    *,
    file: Path,
    stage: str | None = None,
    prefix: str = "",
) -> dict[str, Any]:
    """Every key known and well typed; returns the table (a dict) for convenience."""
    if not isinstance(data, dict):
        raise RepositoryError(
            f"expected a table, got {type(data).__name__}",
            file=file,
            stage=stage,
            field=prefix.rstrip(".") or None,
        )
    for key, value in data.items():
        spec = fields.get(key)
        if spec is None:
            raise RepositoryError(
                f"unknown field; valid fields: {', '.join(fields)}",
                file=file,
                stage=stage,
                field=prefix + key,
            )
        problem = spec.check(value)
        if problem is not None:
            raise RepositoryError(problem, file=file, stage=stage, field=prefix + key)
    return data
