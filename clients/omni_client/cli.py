"""Console script (not yet)."""

import sys


def main(argv: list[str] | None = None) -> int:
    print("omni_client: not yet", file=sys.stderr)
    return 2
