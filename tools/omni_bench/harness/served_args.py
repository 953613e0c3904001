"""The options every served benchmark takes the same way (`higgs-serve`, `chat-serve`,
`omni-serve`): how many requests a level sends, how long the server may take to start, where
the results go, and the omni-server arguments after `--`."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_served_options(p: argparse.ArgumentParser, name: str, ready_timeout_s: float) -> None:
    """--rounds, --min-requests, --ready-timeout, --out (bench-results/NAME) and the trailing
    omni-server arguments."""
    p.add_argument("--rounds", type=int, default=2, help="requests per level: rounds x c (2)")
    p.add_argument("--min-requests", type=int, default=8, help="at least this many a level (8)")
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=ready_timeout_s,
        help=f"server start, seconds ({ready_timeout_s:g})",
    )
    p.add_argument("--out", type=Path, default=Path("bench-results") / name)
    p.add_argument("extra", nargs="*", help="more omni-server arguments, after --")
