"""``ckptfmt sync SRC DST [--name NAME ...] [--json] [--no-verify]``: copy checkpoints to another repository."""

from __future__ import annotations

import argparse
import dataclasses

from rich.console import Console

from ckptfmt.tools.formatting import counted, human_bytes, seconds
from ckptfmt.tools.output import Output


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``sync`` command to the ``ckptfmt`` parser."""
    p = subparsers.add_parser("sync", help="copy checkpoints to another repository: only the chunks it lacks, "
                                           "each checked, every checkpoint committed last")
    p.add_argument("src", help="source repository URL")
    p.add_argument("dst", help="destination repository URL (created if missing)")
    p.add_argument("--name", action="append", metavar="NAME",
                   help="a checkpoint to copy (repeatable; default: every one the destination lacks)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="do not read each chunk back from the destination (the source's copy is still checked)")
    p.set_defaults(run=sync_command)


def sync_command(args, console: Console) -> int:
    """Replicate ``args.src`` to ``args.dst``; print a one-line summary, or JSON with ``args.json``."""
    from ckptfmt.cli.render import ByteProgress  # imported when it runs: CLI startup
    from ckptfmt.lifecycle.replicate import replicate

    with ByteProgress("copying", quiet=args.json) as progress:
        report = replicate(args.src, args.dst, args.name, verify=args.verify, callback=progress)
    if args.json:
        Output(console).json(dataclasses.asdict(report))
        return 0
    rate = f" ({human_bytes(report.bytes_copied / report.seconds)}/s)" if (
        report.bytes_copied >= 64 * 2**20 and report.seconds >= 0.05) else ""
    extras = f", {counted(report.signatures_copied, 'signature')}" if report.signatures_copied else ""
    if report.histories_copied:
        extras += f", {counted(report.histories_copied, 'history object')}"
    Output(console).line(f"{report.destination}: copied {counted(len(report.copied), 'checkpoint')}, "
                         f"{len(report.present)} already there; {counted(report.chunks_copied, 'chunk')}, "
                         f"{human_bytes(report.bytes_copied)}{extras} in {seconds(report.seconds)}{rate}; "
                         f"{counted(report.chunks_skipped, 'chunk')} ({human_bytes(report.bytes_skipped)}) "
                         "were there already")
    return 0
