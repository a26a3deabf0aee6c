"""``ckptfmt verify`` and ``ckptfmt diff``: every byte checked, and what changed between two checkpoints."""

from __future__ import annotations

import argparse
import warnings
from typing import Any

from rich.console import Console
from rich.text import Text

from ckptfmt.cli.shared import found, jsonable
from ckptfmt.errors import CheckpointWarning, quoted
from ckptfmt.tools.formatting import counted, human_bytes, number, seconds, shape_text, short
from ckptfmt.tools.output import KEY, NAME, TEXT, Column, Output


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``verify`` and ``diff`` commands to the ``ckptfmt`` parser."""
    p = subparsers.add_parser("verify", help="check every byte of a checkpoint or a whole repository")
    p.add_argument("url", help="checkpoint or repository URL")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--stats", action="store_true",
                   help="also recompute each tensor's recorded statistics from its bytes")
    p.add_argument("--trusted-key", dest="trusted_keys", action="append", metavar="KEY.pub",
                   help="a public key (any algorithm of ckptfmt keygen); a checkpoint no trusted key signed is a "
                        "problem (repeatable)")
    p.set_defaults(run=verify_command)

    p = subparsers.add_parser("diff", help="compare two checkpoints")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-measure", dest="measure", action="store_false", help="do not read changed tensors")
    p.add_argument("--limit", type=int, default=25, help="differing tensors to list (0: all)")
    p.set_defaults(run=diff_command)


def verify_command(args, console: Console) -> int:
    from ckptfmt.cli.render import ByteProgress  # each command's work, imported when it runs: CLI startup
    from ckptfmt.tools.verify import verify

    with ByteProgress("verifying", quiet=args.json) as progress:
        report = verify(args.url, callback=progress, stats=args.stats, trusted_keys=args.trusted_keys)
    if args.json:
        Output(console).json({
            "ok": report.ok, "checkpoints": report.checkpoints, "chunks_checked": report.chunks_checked,
            "bytes_checked": report.bytes_checked, "seconds": report.seconds,
            "protected": report.protected, "parity_bytes_checked": report.parity_bytes_checked,
            **({"stats_checked": report.stats_checked} if args.stats else {}),
            "problems": [p.__dict__ | {"tensors": list(p.tensors)} for p in report.problems],
            "divergences": report.divergences,
            "warnings": report.warnings,
        })
        return 0 if report.ok else 1
    for message in report.warnings:
        warnings.warn(message, CheckpointWarning, stacklevel=1)
    checked = f", statistics of {counted(report.stats_checked, 'tensor')}" if args.stats else ""
    if report.protected:
        checked += f", {human_bytes(report.parity_bytes_checked)} of parity"
    summary = (f"{counted(len(report.checkpoints), 'checkpoint')}, {counted(report.chunks_checked, 'chunk')}, "
               f"{human_bytes(report.bytes_checked)}{checked} in {seconds(report.seconds)}{_rate(report)}")
    out = Output(console)
    if report.ok:
        out.line(Text.assemble(("OK", "green"), f": {summary}"))
        return 0
    out.line(Text.assemble(("DAMAGED", "bold red"), f": {counted(len(report.problems), 'problem')} in {summary}"))
    columns = [Column("checkpoint", KEY), Column("problem"), Column("chunk"), Column("tensors", NAME),
               Column("detail", TEXT)]
    out.table(None, columns, ((p.checkpoint, p.kind, (p.chunk or "-")[:16], "\n".join(p.tensors) or "-",
                               p.message + (f" ({p.parity})" if p.parity else "")) for p in report.problems))
    rebuildable = sum(" can rebuild" in (p.parity or "") for p in report.problems)
    if rebuildable:
        out.line(f"parity can rebuild {counted(rebuildable, 'of them', 'of them')}: ckptfmt repair {args.url}")
    return 1


#: Below this much data or time a rate says nothing (a few KiB in a millisecond is not a throughput).
_RATE_FLOOR_BYTES, _RATE_FLOOR_S = 64 * 2**20, 0.05


def _rate(report) -> str:
    """' (2.6 GiB/s)', or nothing where the run was too small to measure a rate."""
    if report.bytes_checked < _RATE_FLOOR_BYTES or report.seconds < _RATE_FLOOR_S:
        return ""
    return f" ({human_bytes(report.bytes_checked / report.seconds)}/s)"


def diff_command(args, console: Console) -> int:
    from ckptfmt.tools.diff import diff

    report = diff(args.a, args.b, measure=args.measure)
    if args.json:
        Output(console).json(jsonable({
            "a": report.a, "b": report.b,
            "tensors": [t.__dict__ for t in report.tensors],
            "values": [{"key": k, "a": va, "b": vb} for k, va, vb in report.values],
            "metadata": [{"field": f, "a": va, "b": vb} for f, va, vb in report.metadata],
        }))
        return found(report.differs)
    out = Output(console)
    counts = {s: len(report.by_status(s)) for s in ("changed", "added", "removed", "unchanged")}
    out.line(Text.assemble((report.a, "bold"), " -> ", (report.b, "bold"), ": ",
                           ", ".join(f"{n} {s}" for s, n in counts.items())))
    moved = [t for t in report.tensors if t.status != "unchanged"]
    shown = moved if args.limit <= 0 else moved[: args.limit]
    if moved:
        columns = [Column("key", KEY), Column("status"), Column("dtype"), Column("shape"),
                   *(Column(header, right=True) for header in ("max |diff|", "rel L2", "changed"))]
        out.table(f"tensors that differ, most moved first ({len(shown)} of {len(moved)})", columns,
                  map(_tensor_difference, shown))
    if report.values:
        out.table(f"values that differ ({counted(len(report.values), 'key')})",
                  [Column("key", KEY), Column("A", TEXT), Column("B", TEXT)],
                  ((key, quoted(va), quoted(vb)) for key, va, vb in report.values))
    if report.metadata:
        out.table(f"metadata that differs ({len(report.metadata)} fields; RNG states and packages summarised)",
                  [Column("field", KEY), Column("A", TEXT), Column("B", TEXT)], _metadata_differences(report.metadata))
    return found(report.differs)


def _tensor_difference(t) -> tuple[str, ...]:
    """A row of diff's tensor table: key, status, dtype and shape (A -> B where they changed), how far it moved."""
    dtype = t.dtype[0] if t.dtype[0] == t.dtype[1] else f"{t.dtype[0]} -> {t.dtype[1]}"
    shape = shape_text(t.shape[0]) if t.shape[0] == t.shape[1] else \
        f"{shape_text(t.shape[0])} -> {shape_text(t.shape[1])}"
    changed = f"{t.frac_changed:.1%}" if t.frac_changed is not None else "-"
    return t.key, t.status, dtype, shape, number(t.max_abs_diff), number(t.rel_l2), changed


def _metadata_differences(metadata: list[tuple[str, Any, Any]]) -> list[tuple[str, str, str]]:
    """Rows of diff's metadata table: each field that differs; RNG states and package versions counted."""
    rows = [(field, short(va), short(vb)) for field, va, vb in metadata
            if not field.startswith(("rng.", "environment.packages"))]
    rng_changed = sorted({field.split(".")[1] for field, _, _ in metadata if field.startswith("rng.")})
    packages = [field for field, _, _ in metadata if field.startswith("environment.packages")]
    if rng_changed:
        rows.append(("rng", f"states differ for rank(s) {', '.join(rng_changed)}", ""))
    if packages:
        rows.append(("packages", f"{len(packages)} package version(s) differ", ""))
    return rows
