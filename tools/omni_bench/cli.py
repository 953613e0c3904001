"""Console script (not yet)."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("omni_bench: not yet", file=sys.stderr)
    return 2
