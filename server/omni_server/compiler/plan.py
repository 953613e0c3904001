"""The compiled pipeline: typed, immutable, shared by the compiler, the runtime and the server.

The compiler (`omni_server.compiler.compiler`) is the only producer of these objects; every
other room only reads them. All collections are tuples or read-only mappings (`FrozenMap`) so a
plan can be handed to child processes (pickled) and shared between threads without copies or
locks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any


class FrozenMap(Mapping[str, Any]):
    """A read-only mapping that, unlike MappingProxyType, pickles (plans go to child processes)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._data = dict(data or {})

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self.items()) == dict(other.items())

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenMap, (self._data,))


EMPTY: Mapping[str, Any] = FrozenMap()


class SchedulerKind(StrEnum):
    SINGLE = "single"  # one request at a time: execute([request])
    BATCH = "batch"  # dynamic batches: execute(requests), max_batch_size / max_queue_delay_ms
    STREAM = "stream"  # per-request generators: generate(request) yields chunks
    AR = "ar"  # continuous batching: add(request), step() for all, abort(request)


class BindingPolicy(StrEnum):
    """How admission picks a request's replica of a replicated process (pipeline/binding.py)."""

    ROUND_ROBIN = "round_robin"  # in turn (the reference design's rule); the default
    LEAST_LOADED = "least_loaded"  # the replica with the fewest requests in flight


class EdgeKind(StrEnum):
    NEXT = "next"  # a full payload handed on by static `next` or by the route function
    STREAM = "stream"  # chunks along `stream_to`, beside normal routing


class MpsMode(StrEnum):
    OFF = "off"
    AUTO = "auto"
    ON = "on"


class DeviceRequest(StrEnum):
    """Where a stage asks to run (`device` in stage.toml); the compiler resolves it against
    the machine's facts into the stage's `gpu` ids (none: the CPU)."""

    CPU = "cpu"  # the CPU, whatever `gpu` says
    GPU = "gpu"  # the `gpu` ids (default 0..tp_size-1); a machine without them fails the start
    AUTO = "auto"  # the `gpu` ids when the machine has them, else the CPU


@dataclass(frozen=True)
class MachineFacts:
    """What the machine offers, as the compiler needs it: found once at the edge (the CLI,
    `omni_server.gpu.devices.discover`) and passed in, so compiling stays pure. The default
    is a machine without a GPU."""

    gpus: int = 0  # CUDA GPUs visible to a program started from the server's environment
    # the CPU cores this server may run on (affinity and cgroup quota) and the memory it may
    # use (physical, or the cgroup's limit): what bounds the stage processes a plan may start
    # (placement.check_machine); None: not known (a caller that did not ask), no bound
    cpus: int | None = None
    memory_bytes: int | None = None

    def has_gpus(self, ids: tuple[int, ...]) -> bool:
        return bool(ids) and max(ids) < self.gpus

    def describe(self) -> str:
        """The fact behind a `device = "auto"` choice: `1 GPU found`, `no GPU found`."""
        if self.gpus == 0:
            return "no GPU found"
        return f"{self.gpus} GPU{'s' if self.gpus > 1 else ''} found"


NO_GPU = MachineFacts()


@dataclass(frozen=True)
class BackendRef:
    """The stage's Python backend: a class in a file of the stage folder."""

    file: Path  # absolute path of the stage's model.py (or the file the descriptor names)
    class_name: str


@dataclass(frozen=True)
class SchedulerSpec:
    kind: SchedulerKind = SchedulerKind.SINGLE
    max_batch_size: int = 1
    max_queue_delay_ms: float = 0.0
    # kind = stream: a second compute thread that runs only requests' first chunks, beside the
    # step in progress (the backend's generate() steps must then be thread-safe)
    first_chunk_lane: bool = False


@dataclass(frozen=True)
class EngineSpec:
    """Marks an engine stage (an autoregressive model with a KV budget)."""

    max_total_tokens: int | None = None  # pinned token budget; weight sharing requires it
    settings: Mapping[str, Any] = EMPTY  # the whole [engine] table, for the backend


@dataclass(frozen=True)
class SamplingSpec:
    """A stage's [sampling]: the defaults of a request that leaves a field out. None: not
    declared, so the API's own default applies (OpenAI's: temperature 1, top_p 1, top_k and
    min_p off, max_tokens up to the context)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None

    def declared(self) -> dict[str, float | int]:
        """The fields the stage declares, in schema order."""
        return {k: v for k, v in self.__dict__.items() if v is not None}


NO_SAMPLING = SamplingSpec()


@dataclass(frozen=True)
class StageSpec:
    name: str  # the stage folder's name
    directory: Path  # absolute path of the stage folder
    backend: BackendRef
    parameters: Mapping[str, Any] = EMPTY  # free-form [parameters], handed to initialize()
    process: str = ""  # logical process name; defaults to the stage name
    gpu: tuple[int, ...] = ()  # () = CPU; one id per TP rank (resolved: `device` applied)
    tp_size: int = 1
    gpu_memory_fraction: float | None = None  # placement budget, never inferred
    next: tuple[str, ...] = ()  # static successors, or the route function's allowed targets
    route: str | None = None  # name of a backend method choosing among `next`
    terminal: bool = False
    wait_for: tuple[str, ...] = ()  # fan-in: upstream stages this stage waits for
    merge: str | None = None  # name of a backend method merging the wait_for payloads
    stream_to: tuple[str, ...] = ()  # chunk stream targets, beside normal routing
    process_local: tuple[str, ...] = ()  # successors whose edge must stay inside one process
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)
    engine: EngineSpec | None = None
    timeout_s: float | None = None  # None: the server's stage_timeout_s; 0: no limit
    sampling: SamplingSpec = NO_SAMPLING  # [sampling]: a request's defaults
    # speaks in voices cloned from a reference clip (docs/voices.md): requests carry the clip
    voice_cloning: bool = False
    # `device` as declared (None: not declared, `gpu` alone decides) and whether its [on_gpu]
    # table was applied: why the stage runs where it does (config resolve's topology)
    device: DeviceRequest | None = None
    on_gpu_applied: bool = False

    @property
    def on_gpu(self) -> bool:
        return bool(self.gpu)


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    kind: EdgeKind
    process_local: bool = False


@dataclass(frozen=True)
class ModelSpec:
    """A served model: its id in /v1/models and the entry of its pipeline."""

    id: str
    entry: str  # entry stage
    tasks: tuple[str, ...]  # API tasks: "speech", "transcription", "chat", "realtime"
    # the stages its requests visit, in pipeline order (the compiler resolves the default:
    # every stage the entry reaches); a request follows no edge out of this set
    stages: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # other ids accepted in requests (e.g. "tts-1")
    voices: tuple[str, ...] = ()  # voices the pipeline knows (speech)
    voice_aliases: Mapping[str, str] = EMPTY  # e.g. OpenAI's "alloy" -> "joe"
    default_voice: str | None = None
    description: str = ""
    language: str | None = None  # BCP 47 tag of its voices, shown in /v1/audio/voices
    # the entry stage's [sampling]: the entry reads a request's sampling fields (the chat
    # contract), so its defaults are the model's
    sampling: SamplingSpec = NO_SAMPLING
    # how it hears audio in: "transcribe" (the repository's transcription model, then text) or
    # "native" (its entry gets the clips as contracts.AudioPart parts of the messages)
    audio_input: str = "transcribe"

    @property
    def hears_audio(self) -> bool:
        """Its entry hears clips itself (an omni model's audio encoder): no transcription."""
        return self.audio_input == "native"


@dataclass(frozen=True)
class ProcessSpec:
    """A logical process: a grouping, spawn and placement boundary."""

    name: str
    stages: tuple[str, ...]
    num_replicas: int = 1
    replica_devices: tuple[int, ...] = ()  # N ids (N x T for TP size T), overrides stage gpus
    tp_size: int = 1  # > 1 only for the process a TP stage owns
    binding: BindingPolicy = BindingPolicy.ROUND_ROBIN  # replica choice at admission


@dataclass(frozen=True)
class ProcessInstance:
    """One OS process: a replica (and TP rank) of a logical process."""

    process: str
    replica: int
    tp_rank: int
    stages: tuple[str, ...]
    devices: Mapping[str, int | None]  # stage -> GPU id, None for a CPU stage
    tp_size: int = 1

    @property
    def name(self) -> str:
        """`talker_ar@r0`; in a TP process the rank is appended: `thinker@r0/tp1`."""
        base = f"{self.process}@r{self.replica}"
        return base if self.tp_size == 1 else f"{base}/tp{self.tp_rank}"


@dataclass(frozen=True)
class ServerOptions:
    mps: MpsMode = MpsMode.OFF
    weight_share: bool = False
    gpu_memory_limit: float = 1.0  # per-GPU limit for the sum of declared fractions
    stage_timeout_s: float = 0.0  # timeout_s of stages that set none (0: no limit)


@dataclass(frozen=True)
class Plan:
    repository: Path
    server: ServerOptions
    stages: Mapping[str, StageSpec]
    models: Mapping[str, ModelSpec]
    processes: Mapping[str, ProcessSpec]
    instances: tuple[ProcessInstance, ...]
    edges: tuple[Edge, ...]
    # repository.toml's free-form [parameters]: every stage's backend sees them
    # (StageContext.repository_parameters), e.g. the checkpoint folder all stages load from
    parameters: Mapping[str, Any] = EMPTY
    # the machine the plan was compiled for, and whether repository.toml's [on_gpu] applied
    # (a stage landed on a GPU): a recompile (model control) must use the same facts
    machine: MachineFacts = NO_GPU
    on_gpu_applied: bool = False

    def process_of(self, stage: str) -> ProcessSpec:
        return self.processes[self.stages[stage].process]

    def same_process(self, src: str, dst: str) -> bool:
        """True when both stages always live in one OS process (same logical process, no TP)."""
        proc = self.process_of(src)
        return proc.name == self.stages[dst].process and proc.tp_size == 1

    def timeout_of(self, stage: str) -> float | None:
        """How long a request may stay at `stage` (seconds), or None for no limit."""
        own = self.stages[stage].timeout_s
        timeout = self.server.stage_timeout_s if own is None else own
        return timeout or None

    def paced_by_credits(self, stage: str) -> bool:
        """Whether `stage`'s chunks reach the caller paced by credits (a slow reader pauses
        its request there, wire/messages.CHUNK_WINDOW): a terminal stream stage, or a terminal
        ar stage fed by chunks (whose steps take what its streams bring). The stage host and
        the coordinator must agree on it: both ask here."""
        spec = self.stages[stage]
        if not spec.terminal:
            return False
        if spec.scheduler.kind is SchedulerKind.STREAM:
            return True
        fed = any(stage in other.stream_to for other in self.stages.values())
        return spec.scheduler.kind is SchedulerKind.AR and fed

    def models_through(self, stage: str) -> dict[str, ModelSpec]:
        """The served models whose requests visit `stage`, by id (StageContext.models)."""
        return {m.id: m for m in self.models.values() if stage in m.stages}

    def instances_of(self, process: str) -> tuple[ProcessInstance, ...]:
        return tuple(i for i in self.instances if i.process == process)

    def model(self, model_id: str) -> ModelSpec | None:
        """The served model called `model_id` or one of its aliases."""
        if model_id in self.models:
            return self.models[model_id]
        for spec in self.models.values():
            if model_id in spec.aliases:
                return spec
        return None
