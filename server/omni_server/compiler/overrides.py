"""Dotted command-line overrides: `--stages.tts_engine.process pipeline` changes one field.

An override is applied to the raw tables before compiling, so it passes every rule a file
value passes. Paths mirror the files:

    --server.<field>                     repository.toml [server]
    --models.<id>.<field>                repository.toml [models.<id>] (voice_aliases.<alias>)
    --processes.<name>.<field>           repository.toml [processes.<name>]
    --stages.<stage>.<field>             <stage>/stage.toml
    --stages.<stage>.scheduler.<field>   its [scheduler]; `--stages.<stage>.max_batch_size` too
    --stages.<stage>.engine.<field>      its [engine]; `--stages.<stage>.max_total_tokens` too
    --stages.<stage>.sampling.<field>    its [sampling] (a request's defaults; no shorthand)
    --stages.<stage>.parameters.<key>    its free-form [parameters] (value read as TOML)
    --parameters.<key>                   repository.toml's free-form [parameters], which every
                                         stage's backend sees (value read as TOML)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from omni_server.compiler.errors import RepositoryError
from omni_server.compiler.files import RawRepository
from omni_server.compiler.schema import (
    ENGINE_FIELDS,
    MODEL_FIELDS,
    PROCESS_FIELDS,
    SCHEDULER_FIELDS,
    SERVER_FIELDS,
    STAGE_FIELDS,
    STAGE_TABLES,
    Field,
    Kind,
    parse_free,
)

ORIGIN = "command line"
ROOTS = ("stages", "processes", "models", "server", "parameters")


@dataclass(frozen=True)
class Override:
    path: str  # dotted, without the leading "--"
    text: str  # the value as typed


def parse_tokens(tokens: Sequence[str]) -> list[Override]:
    """`["--a.b", "v", "--c.d=w"]` -> overrides; anything else is an error naming the token."""
    out: list[Override] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or "." not in token:
            raise RepositoryError(
                f"unexpected argument '{token}': an override is --<path> <value> with a path "
                f"under {', '.join(ROOTS)} (e.g. --stages.tts.max_batch_size 8)",
                file=ORIGIN,
            )
        path, eq, text = token[2:].partition("=")
        if not eq:
            if i + 1 >= len(tokens):
                raise RepositoryError("override has no value", file=ORIGIN, field=path)
            text = tokens[i + 1]
            i += 1
        out.append(Override(path, text))
        i += 1
    return out


def apply_overrides(raw: RawRepository, tokens: Sequence[str]) -> dict[str, str]:
    """Set each override's typed value in the raw tables, in order (a later one wins).

    Returns where each went -> the path as typed: `stages.x.scheduler.max_batch_size` ->
    `stages.x.max_batch_size`, so a rule broken by an overridden value can say so.
    """
    return {_apply(raw, override): override.path for override in parse_tokens(tokens)}


def _apply(raw: RawRepository, ov: Override) -> str:
    """Set one override; returns its canonical path (as the files spell it)."""
    parts = ov.path.split(".")
    root = parts[0]
    if root not in ROOTS:
        _fail(ov, f"unknown path; valid roots: {', '.join(ROOTS)}")
    if root == "parameters":
        if len(parts) < 2 or not all(parts[1:]):
            _fail(ov, "expected --parameters.<key>[.<key>...] <value>")
        _set_free(_table(raw.data, "parameters"), parts[1:], ov)
        return ov.path
    if root == "server":
        if len(parts) != 2:
            _fail(ov, "expected --server.<field>; fields: " + ", ".join(SERVER_FIELDS))
        table = _table(raw.data, "server")
        _set(table, parts[1], SERVER_FIELDS, ov)
        return ov.path
    if len(parts) < 3:
        _fail(ov, f"expected --{root}.<name>.<field>")
    name, rest = parts[1], parts[2:]
    if root == "stages":
        stage = raw.stages.get(name)
        if stage is None:
            _fail(ov, f"unknown stage '{name}'; stages: {', '.join(raw.stages)}", stage=name)
        return f"stages.{name}." + _apply_stage(stage.data, name, rest, ov)
    if root == "processes":
        if len(rest) != 1:
            _fail(ov, "expected --processes.<name>.<field>; fields: " + ", ".join(PROCESS_FIELDS))
        _set(_table(_table(raw.data, "processes"), name), rest[0], PROCESS_FIELDS, ov)
        return ov.path
    model = _table(_table(raw.data, "models"), name)
    if rest[0] == "voice_aliases" and len(rest) == 2:
        _table(model, "voice_aliases")[rest[1]] = ov.text
    elif len(rest) == 1:
        _set(model, rest[0], MODEL_FIELDS, ov)
    else:
        _fail(ov, "expected --models.<id>.<field>; fields: " + ", ".join(MODEL_FIELDS))
    return ov.path


def _apply_stage(data: dict[str, Any], stage: str, rest: list[str], ov: Override) -> str:
    """Set one stage override; returns its path inside stage.toml."""
    head = rest[0]
    if head == "parameters" and len(rest) >= 2:
        _set_free(_table(data, "parameters"), rest[1:], ov)
        return ".".join(rest)
    if head in STAGE_TABLES and len(rest) == 2:
        _set(_table(data, head), rest[1], STAGE_TABLES[head], ov, stage)
        return ".".join(rest)
    if len(rest) == 1:
        # Shorthands: the scheduler's and the engine's fields have names no stage field has.
        if head in SCHEDULER_FIELDS:
            _set(_table(data, "scheduler"), head, SCHEDULER_FIELDS, ov, stage)
            return f"scheduler.{head}"
        if head in ENGINE_FIELDS:
            _set(_table(data, "engine"), head, ENGINE_FIELDS, ov, stage)
            return f"engine.{head}"
        field = STAGE_FIELDS.get(head)
        if field is not None and field.kind is not Kind.TABLE:
            _set(data, head, STAGE_FIELDS, ov, stage)
            return head
    valid = [f for f, spec in STAGE_FIELDS.items() if spec.kind is not Kind.TABLE]
    valid += [*SCHEDULER_FIELDS, *ENGINE_FIELDS, "scheduler.<f>", "engine.<f>", "sampling.<f>"]
    valid += ["parameters.<key>"]
    _fail(ov, "unknown stage field; valid: " + ", ".join(valid), stage=stage)


def _set_free(table: dict[str, Any], keys: list[str], ov: Override) -> None:
    """A free-form [parameters] key (nested tables created): the value read as TOML."""
    for key in keys[:-1]:
        table = _table(table, key)
    table[keys[-1]] = parse_free(ov.text)


def _set(
    table: dict[str, Any],
    name: str,
    fields: Mapping[str, Field],
    ov: Override,
    stage: str | None = None,
) -> None:
    field = fields.get(name)
    if field is None:
        _fail(ov, f"unknown field '{name}'; valid: {', '.join(fields)}", stage=stage)
    value = field.parse(ov.text)
    problem = field.check(value)
    if problem is not None:
        _fail(ov, problem, stage=stage)
    table[name] = value


def _table(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.setdefault(key, {})
    if not isinstance(value, dict):
        raise RepositoryError(
            f"cannot override inside '{key}': the file gives it as {type(value).__name__}, "
            "not a table",
            file=ORIGIN,
            field=key,
        )
    return value


def _fail(ov: Override, message: str, stage: str | None = None) -> NoReturn:
    raise RepositoryError(message, file=ORIGIN, stage=stage, field=ov.path)
