"""The `omni-server` command line."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print("omni-server: not yet", file=sys.stderr)
    return 2
