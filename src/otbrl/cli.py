"""Command-line entry point (placeholder until the trainer lands)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print("otbrl: no commands yet", file=sys.stderr)
    return 2
