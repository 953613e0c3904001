"""`EngineConfig`: how one engine instance runs, and the one declaration of a stage's `[engine]`
table (every field's type, range, default and meaning, and every check's message).

Three readers, one source: the engine runs it (omni_server.engine re-exports it); the compiler
checks a stage.toml's `[engine]` table with `check_table` before any process starts, naming the
file, stage and field (compiler/schema.py derives its ENGINE_FIELDS from `table_fields`); and
docs/engine.md's field table is `docs_table()` (a test holds them equal). Torch-free, so the
compiler stays pure: the dtype becomes a torch dtype only in the engine (`torch_dtype`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The KV budget in tokens when nothing sizes it (the CPU, or a GPU stage without a fraction).
DEFAULT_MAX_TOTAL_TOKENS = 16384

DTYPE_NAMES = ("float32", "bfloat16", "float16")
DECODE_ATTENTION = ("auto", "paged", "gather")
CPU_WEIGHT_ORDER = ("rows", "columns")
OVERLAP_DECODE = ("auto", "on", "off")


class EngineConfigError(ValueError):
    """A field of EngineConfig that is wrong: `field` names it, `problem` says what was found
    against what is valid (the message is "engine.<field> <problem>")."""

    def __init__(self, field: str, problem: str, table_key: bool = True) -> None:
        self.field = field
        self.problem = problem
        super().__init__(f"{'engine.' if table_key else ''}{field} {problem}")


def _setting(
    default: Any,
    doc: str,
    *,
    kind: str,  # "int" | "bool" | "choice" | "device" | "fraction"
    shown: str | None = None,  # the default as docs/engine.md shows it
    minimum: int = 1,
    choices: tuple[str, ...] = (),
    optional: bool = False,  # None is valid (the engine picks)
    table: bool = True,  # an [engine] key (False: the stage's own field, passed on)
) -> Any:
    metadata = {
        "doc": doc,
        "kind": kind,
        "shown": shown,
        "minimum": minimum,
        "choices": choices,
        "optional": optional,
        "table": table,
    }
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class EngineConfig:
    """How one engine instance runs. Every field but `device` and `gpu_memory_fraction` can
    come from a stage's `[engine]` table (`from_table`); each field's meaning is its `doc`
    (`docs_table()`, docs/engine.md)."""

    max_total_tokens: int | None = _setting(
        None,
        "KV capacity in tokens, all requests together; allocated once. Absent: sized from "
        "`gpu_memory_fraction` on a GPU (below), else 16384",
        kind="int",
        shown="sized / 16384",
        optional=True,
    )
    max_batch_size: int = _setting(
        64,
        "most requests in one step (prefilling or decoding); media requests ahead of their "
        "listeners may hold KV beyond it while sitting a step out (below)",
        kind="int",
    )
    max_step_tokens: int = _setting(
        512,
        "budget of one forward in tokens weighted by their attention's cost (a token at "
        "context c counts 1 + c / K, `step_cost.py`): decodes first, prefill chunks fill the "
        "rest (GPU: 2048-4096); must exceed `max_batch_size`",
        kind="int",
        minimum=2,
    )
    attention_keys_per_token: int | None = _setting(
        None,
        "K above: the context at which a token's attention costs as much as its matmuls (FLOP "
        "ratio x 0.2 on the CPU, x 0.1 on CUDA, both measured)",
        kind="int",
        shown="from the shape",
        optional=True,
    )
    max_prefill_beside_decodes: int | None = _setting(
        None,
        "while requests decode, a step's prefill chunks cost at most this or the decodes' own "
        "cost, whichever is larger: a running stream's step at most about doubles",
        kind="int",
        shown="32 CPU / `max_step_tokens` CUDA",
        optional=True,
    )
    decode_attention: str = _setting(
        "auto",
        "`paged`: the Triton kernel over the block tables (CUDA; refused elsewhere), `gather`: "
        "gather + torch matmuls (the CPU's; on the CPU a lone request whose blocks are "
        "consecutive is read in place, nothing gathered), `auto`: paged where it can run",
        kind="choice",
        choices=DECODE_ATTENTION,
    )
    max_seq_len: int | None = _setting(
        None,
        "longest prompt + completion; clamped to `max_total_tokens`",
        kind="int",
        shown="model context",
        minimum=2,
        optional=True,
    )
    block_size: int = _setting(16, "tokens per KV block", kind="int")
    dtype: str = _setting(
        "float32",
        "`float32`, `bfloat16`, `float16` (CPU: fp32 or bf16; GPU: bf16)",
        kind="choice",
        choices=DTYPE_NAMES,
    )
    device: str = _setting("cpu", "`cpu`, `cuda`, `cuda:N`", kind="device", table=False)
    cuda_graphs: bool = _setting(True, "CUDA: decode steps replay captured graphs", kind="bool")
    compile: bool = _setting(
        False, "`torch.compile` the forward (inside the graphs on CUDA)", kind="bool"
    )
    playback_order: bool = _setting(
        True,
        "a step that cannot hold everyone is ordered by media requests' listener deadlines "
        "([below](#playback-aware-order)); false: the plain order (the benchmark's peer)",
        kind="bool",
    )
    cpu_weight_order: str = _setting(
        "rows",
        "`columns`: on the CPU in float32, the wide weights (QKV, gate/up, the head) stored by "
        "columns, fast for one row, slower for 4-8 "
        "([below](#cpu-the-weights-order-issue-23-2026-12-02))",
        kind="choice",
        choices=CPU_WEIGHT_ORDER,
    )
    overlap_decode: str = _setting(
        "auto",
        "`on` / `off`: launch a decode step before the previous step's tokens are read, its "
        "ids taken on the device from that step's draws (argmax or seeded sample, "
        "`overlap.py`); `auto` where "
        "decode graphs run, one rank, models whose head draws the argmax (text); `on` also "
        "eager steps (tests)",
        kind="choice",
        choices=OVERLAP_DECODE,
    )
    gpu_memory_fraction: float | None = _setting(
        None,
        "the stage's share of its GPU (the stage's own field, passed on by its backend, not an "
        "`[engine]` key): sizes or checks the KV cache on a GPU; ignored on the CPU",
        kind="fraction",
        shown="none",
        optional=True,
        table=False,
    )

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            problem = _problem(field, getattr(self, field.name))
            if problem is not None:
                raise EngineConfigError(field.name, problem, field.metadata["table"])
        if self.max_step_tokens <= self.max_batch_size:
            raise EngineConfigError(
                "max_step_tokens",
                f"must exceed engine.max_batch_size ({self.max_batch_size}), got "
                f"{self.max_step_tokens}: decodes take one token each and prefill needs the rest",
            )

    @property
    def sized_from_fraction(self) -> bool:
        """The KV cache takes what the GPU budget leaves (no pinned max_total_tokens)."""
        return (
            self.max_total_tokens is None
            and self.gpu_memory_fraction is not None
            and self.device.startswith("cuda")
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype)  # the names of DTYPE_NAMES
        return dtype

    @classmethod
    def from_table(cls, table: Mapping[str, object]) -> EngineConfig:
        """Build from a stage.toml `[engine]` table; unknown keys and wrong types are errors."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(table) - fields)
        if unknown:
            raise ValueError(f"unknown engine field(s) {unknown}; valid: {sorted(fields)}")
        return cls(**table)  # type: ignore[arg-type]  # __post_init__ checks every value


def table_fields() -> Iterator[dataclasses.Field[Any]]:
    """The fields an `[engine]` table may set, in declaration order (metadata: doc, kind,
    minimum, choices)."""
    return (f for f in dataclasses.fields(EngineConfig) if f.metadata["table"])


def field_problem(name: str, value: Any) -> str | None:
    """What is wrong with `value` for [engine] field `name` (None: valid), as EngineConfig says
    it: the compiler's check of one field."""
    field = next(f for f in dataclasses.fields(EngineConfig) if f.name == name)
    return _problem(field, value)


def check_table(table: Mapping[str, Any]) -> None:
    """EngineConfigError for the first wrong field of an [engine] table of known keys (each
    field alone, then across fields: max_step_tokens > max_batch_size)."""
    EngineConfig(**table)


def docs_table() -> list[str]:
    """docs/engine.md's field table, rows as Markdown."""
    rows = ["| field | default | meaning |", "| --- | --- | --- |"]
    for field in dataclasses.fields(EngineConfig):
        shown = field.metadata["shown"] or _shown(field.default)
        rows.append(f"| `{field.name}` | {shown} | {field.metadata['doc']} |")
    return rows


def _shown(default: Any) -> str:
    if isinstance(default, bool):
        return "true" if default else "false"
    return f"`{default}`" if isinstance(default, str) else str(default)


def _problem(field: dataclasses.Field[Any], value: Any) -> str | None:
    meta = field.metadata
    if value is None and meta["optional"]:
        return None
    valid, wanted = _RULES[meta["kind"]](meta, value)
    return None if valid else f"must be {wanted}, got {_toml(value)}"


def _toml(value: Any) -> str:
    """A value as a stage file writes it (the compiler's messages show values so too)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _int(meta: Mapping[str, Any], value: Any) -> tuple[bool, str]:
    minimum = meta["minimum"]
    wanted = "a positive integer" if minimum == 1 else f"an integer > {minimum - 1}"
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum, wanted


def _bool(meta: Mapping[str, Any], value: Any) -> tuple[bool, str]:
    return isinstance(value, bool), "true or false"


def _choice(meta: Mapping[str, Any], value: Any) -> tuple[bool, str]:
    return value in meta["choices"], "one of " + ", ".join(f'"{c}"' for c in meta["choices"])


def _device(meta: Mapping[str, Any], value: Any) -> tuple[bool, str]:
    valid = isinstance(value, str) and (value == "cpu" or value.startswith("cuda"))
    return valid, "'cpu' or 'cuda[:N]'"


def _fraction(meta: Mapping[str, Any], value: Any) -> tuple[bool, str]:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and 0 < value <= 1, "a number in (0, 1]"


_RULES = {"int": _int, "bool": _bool, "choice": _choice, "device": _device, "fraction": _fraction}
