"""Batch synthesis: one audio file per non-blank line of a text file, N requests in flight."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from omni_client.async_client import AsyncOmniClient
from omni_client.errors import APIError


@dataclass
class Line:
    number: int  # 1-based line number in the input file: names the output file
    text: str


@dataclass
class BatchResult:
    written: list[Path] = field(default_factory=list)
    rejected: list[tuple[Line, APIError]] = field(default_factory=list)  # per-line API errors


def read_lines(path: Path) -> list[Line]:
    """Non-blank lines, stripped; blank lines are skipped but still count for numbering."""
    text = path.read_text(encoding="utf-8")
    return [Line(n, s.strip()) for n, s in enumerate(text.splitlines(), 1) if s.strip()]


def output_path(out_dir: Path, line: Line, width: int, format: str) -> Path:
    return out_dir / f"{line.number:0{width}d}.{format}"


async def synthesize_lines(
    client: AsyncOmniClient,
    lines: list[Line],
    out_dir: Path,
    *,
    format: str,
    concurrency: int,
    progress: bool,
    options: dict[str, Any],
) -> BatchResult:
    """Write every line's audio into `out_dir`.

    A line the server rejects (`APIError`) is recorded and the batch goes on; losing the
    server (`OmniConnectionError`) cancels the lines still running and propagates, since every
    other line would fail the same way.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    width = max(4, len(str(lines[-1].number))) if lines else 4
    result = BatchResult()
    slots = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(lines), unit="line", disable=not progress, dynamic_ncols=True)

    async def one(line: Line) -> None:
        async with slots:
            path = output_path(out_dir, line, width, format)
            try:
                await client.speech_to_file(path, line.text, format=format, **options)
            except APIError as e:
                result.rejected.append((line, e))
                bar.write(f"omni-client: line {line.number}: {e}", file=sys.stderr)
            else:
                result.written.append(path)
            bar.update(1)

    try:
        async with asyncio.TaskGroup() as group:
            for line in lines:
                group.create_task(one(line))
    except ExceptionGroup as group_error:
        # the first failure (the server lost, a file not writable) cancelled the rest: report it
        raise group_error.exceptions[0] from None
    finally:
        bar.close()
    return result
