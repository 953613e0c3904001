"""Markdown tables, the one output format of every benchmark: a header (column names and their
alignment), then rows, printed as each is measured or joined at the end."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

RULES = {"l": "---", "r": "---:"}


def header(columns: Sequence[str], align: str = "") -> list[str]:
    """The column names and the rule under them; `align` has one letter per column, "l" (the
    default for columns it does not reach) or "r" (numbers)."""
    rules = [RULES[align[i] if i < len(align) else "l"] for i in range(len(columns))]
    return [row(columns), "|" + "|".join(rules) + "|"]


def row(cells: Iterable[object]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(columns: Sequence[str], rows: Iterable[Iterable[object]], align: str = "") -> str:
    return "\n".join([*header(columns, align), *(row(r) for r in rows)])
