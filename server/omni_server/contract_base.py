"""The base of every typed stage contract (omni_server/contracts.py): a frozen dataclass that
checks itself in `__post_init__`, is pickled as its constructor call (so decoding checks it
again) and is read from a payload typed (`Contract.of`); and the small checks its fields
share. A leaf module.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar, cast

C = TypeVar("C", bound="Contract")


class Contract:
    """The base of every contract: a frozen dataclass whose `__post_init__` checks it."""

    KEY: ClassVar[str]  # where a payload holds it
    # True: it crosses between stages only (a stream_to edge); a terminal stage's chunks reach
    # the caller without it (stage/node.py), as Qwen3-Omni's thinker -> talker contracts
    STAGES_ONLY: ClassVar[bool] = False

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # pickled as a constructor call, never as a bare __dict__: decoding re-checks
        values = tuple(getattr(self, name) for name in _names(self))
        return (type(self), values)

    @classmethod
    def of(cls: type[C], payload: Mapping[str, Any]) -> C:
        """The contract a payload holds under `KEY`; TypeError naming the key otherwise (a
        stage wired to the wrong upstream, or a payload built by hand)."""
        value = payload.get(cls.KEY)
        if not isinstance(value, cls):
            raise TypeError(
                f"payload[{cls.KEY!r}] must be an omni_server.contracts.{cls.__name__}; "
                f"found {type(value).__name__}"
            )
        return value

    def to_dict(self) -> dict[str, Any]:
        """Plain values (JSON's types): for logs, tests and the docs."""
        return _plain(self)


def _names(contract: Contract) -> list[str]:
    """A contract's field names, in declaration order (every contract is a dataclass)."""
    return [f.name for f in dataclasses.fields(cast(Any, contract))]


def _plain(value: Any) -> Any:
    if isinstance(value, Contract):
        if type(value).to_dict is not Contract.to_dict:  # its own plain form (no raw bytes)
            return value.to_dict()
        return {name: _plain(getattr(value, name)) for name in _names(value)}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check_text(name: str, value: Any, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string; got {type(value).__name__}")
