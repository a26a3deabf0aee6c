"""The ``ckptfmt tui`` command, registered through the ``ckptfmt.commands`` entry point so that the
core CLI never imports the TUI; textual is imported only when the command runs."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from ckptfmt.errors import CheckpointError


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``tui`` to the ``ckptfmt`` command's subparsers."""
    p = sub.add_parser("tui", help="browse, verify and compare checkpoints in a terminal UI")
    p.add_argument("targets", nargs="+", metavar="TARGET",
                   help="a repository or checkpoint URL; give two checkpoints to open their diff")
    p.add_argument("--compare", metavar="RUN_B", default=None,
                   help="open the run screen comparing the TARGET run (a repository) with this one")
    p.add_argument("--min-delay", type=float, default=None, metavar="SECONDS",
                   help="the run screen reports no straggler delay shorter than this (default 0.01)")
    p.set_defaults(run=run)


def run(args, console: Console) -> int:
    if not _is_terminal(sys.stdout) or not _is_terminal(sys.stdin):
        raise CheckpointError("ckptfmt tui needs a terminal, and its input or output is a pipe or a file: "
                              "use ckptfmt ls, show or diff there")
    try:
        import textual  # noqa: F401 - only to tell a missing extra from a broken install
    except ImportError:
        raise CheckpointError("the terminal UI needs textual: pip install 'ckptfmt[tui]'") from None
    from ckptfmt.tui.app import main

    return main(args.targets, compare_with=args.compare, min_delay=args.min_delay)


def _is_terminal(stream) -> bool:
    """Whether ``stream`` is a terminal; a closed or replaced stream (None, no ``isatty``) is not."""
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError):
        return False
