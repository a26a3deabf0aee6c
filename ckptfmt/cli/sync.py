"""``ckptfmt sync SRC DST [--name NAME ...] [--format-version V [--sign KEY]] [--json] [--no-verify]``: copy
checkpoints to another repository, or rewrite them for readers of an older format version."""

from __future__ import annotations

import argparse
import dataclasses

from rich.console import Console

from ckptfmt.errors import CheckpointError, UnsupportedValueError
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
    p.add_argument("--format-version", metavar="V", type=_format_version,
                   help="write for readers of format V (e.g. 1.6): checkpoints they cannot read are re-encoded "
                        "(new manifests; their signatures are dropped)")
    p.add_argument("--sign", metavar="KEY",
                   help="sign the checkpoints rewritten for --format-version with this private key")
    p.set_defaults(run=sync_command)


def _format_version(value: str) -> str:
    """``--format-version``'s value, checked here so that a bad one is a usage error."""
    from ckptfmt.format.features import parse_version
    from ckptfmt.format.version import writable

    try:
        writable(parse_version(value))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def sync_command(args, console: Console) -> int:
    """Replicate ``args.src`` to ``args.dst``; print a one-line summary, or JSON with ``args.json``."""
    from ckptfmt.cli.render import ByteProgress  # imported when it runs: CLI startup
    from ckptfmt.format.features import parse_version, version_text
    from ckptfmt.lifecycle.replicate import replicate
    from ckptfmt.saving.options import SIGNATURES_FROM

    if args.sign is not None and args.format_version is None:
        raise UnsupportedValueError("--sign signs the checkpoints rewritten for --format-version; give that too")
    if args.sign is not None and parse_version(args.format_version) < SIGNATURES_FROM:
        raise UnsupportedValueError(f"--sign needs format {version_text(SIGNATURES_FROM)} (signatures, spec 10.3); "
                                    f"format {args.format_version} cannot express it")
    with ByteProgress("copying", quiet=args.json) as progress:
        try:
            report = replicate(args.src, args.dst, args.name, verify=args.verify, callback=progress,
                               format_version=args.format_version, signer=args.sign)
        except ValueError as exc:  # an option the version cannot express (--sign below 1.7)
            if isinstance(exc, CheckpointError):
                raise
            raise UnsupportedValueError(str(exc)) from None
    if args.json:
        Output(console).json(dataclasses.asdict(report))
        return 0
    rate = f" ({human_bytes(report.bytes_copied / report.seconds)}/s)" if (
        report.bytes_copied >= 64 * 2**20 and report.seconds >= 0.05) else ""
    extras = f", {counted(report.signatures_copied, 'signature')}" if report.signatures_copied else ""
    if report.histories_copied:
        extras += f", {counted(report.histories_copied, 'history object')}"
    if report.format_version is not None:
        extras += (f"; rewrote {counted(len(report.rewritten), 'checkpoint')} for format {report.format_version} "
                   f"({counted(report.chunks_reencoded, 'chunk')} re-encoded)")
        if report.signatures_dropped:
            extras += (f", dropped {counted(report.signatures_dropped, 'signature')} (they sign the source's "
                       "manifests)")
        if report.signatures_written:
            extras += f", signed {counted(report.signatures_written, 'checkpoint')}"
    Output(console).line(f"{report.destination}: copied {counted(len(report.copied), 'checkpoint')}, "
                         f"{len(report.present)} already there; {counted(report.chunks_copied, 'chunk')}, "
                         f"{human_bytes(report.bytes_copied)}{extras} in {seconds(report.seconds)}{rate}; "
                         f"{counted(report.chunks_skipped, 'chunk')} ({human_bytes(report.bytes_skipped)}) "
                         "were there already")
    return 0
