"""``ckptfmt sync SRC DST [--name NAME ...] [--json] [--no-verify]``: copy checkpoints to another repository."""

from __future__ import annotations

import argparse
import dataclasses

from rich.console import Console

from ckptfmt.cli.render import ByteProgress
from ckptfmt.lifecycle.replicate import replicate
from ckptfmt.tools.formatting import human_bytes
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
    with ByteProgress("copying", quiet=args.json) as progress:
        report = replicate(args.src, args.dst, args.name, verify=args.verify, progress=progress)
    if args.json:
        Output(console).json(dataclasses.asdict(report))
        return 0
    rate = report.bytes_copied / report.seconds / 1e6 if report.seconds else 0.0
    Output(console).line(f"{report.destination}: copied {len(report.copied)} checkpoint(s), "
                         f"{len(report.present)} already there; {report.chunks_copied} chunks, "
                         f"{human_bytes(report.bytes_copied)} in {report.seconds:.2f} s ({rate:.1f} MB/s); "
                         f"{report.chunks_skipped} chunks ({human_bytes(report.bytes_skipped)}) were there already")
    return 0
