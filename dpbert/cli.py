"""The `dpbert` command: thin, one subcommand per user task.

Each `_add_<name>` function below declares one subcommand's flags and binds the library
function that does the work; nothing here computes anything itself.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import dpbert

def _commands() -> list[Callable[..., None]]:
    """Subcommands in the order `dpbert --help` lists them (only ones that work)."""
    return []


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpbert",
        description="Differentially private BERT: pretrain, account, release, fine-tune, demo.",
    )
    parser.add_argument("--version", action="version", version=f"dpbert {dpbert.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _commands():
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as err:
        # Library code raises these with messages that name the field/file; show them plainly.
        print(f"dpbert {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
