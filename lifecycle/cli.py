"""`python -m lifecycle ...`: the machine's diagram, and tools for checkpoints on disk."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from lifecycle.errors import LifecycleError
from lifecycle.machine import mermaid


def _diagram(args: argparse.Namespace) -> int:
    sys.stdout.write(mermaid())
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lifecycle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    diagram = sub.add_parser("diagram", help="print the state machine as a Mermaid diagram")
    diagram.set_defaults(run=_diagram)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except LifecycleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
