"""``ckptfmt health RUN [--deep] [--zeros SHARE] [--json]``: a run's training health from its checkpoints.

Exits 1 when a checkpoint holds NaN or infinite values (the run diverged), 0
otherwise: the other findings (norm jumps, loss spikes, unchanged tensors) are
signs to look at, not verdicts.
"""

from __future__ import annotations

import argparse
import math

from rich.console import Console

from ckptfmt.errors import CheckpointError
from ckptfmt.tools.formatting import counted, number, short
from ckptfmt.tools.output import KEY, NAME, TEXT, Column, Output


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``health`` command to the ``ckptfmt`` parser."""
    p = subparsers.add_parser("health", help="a run's training health from its checkpoints: NaN/Inf, norm jumps, "
                                             "unchanged and mostly-zero tensors, loss spikes (needs "
                                             "ckptfmt[analytics])")
    p.add_argument("repo", help="repository URL of one run")
    p.add_argument("--deep", action="store_true",
                   help="also read the tensors that changed between checkpoints and measure how far each moved")
    p.add_argument("--zeros", type=float, default=0.5, metavar="SHARE",
                   help="list tensors whose share of exact zeros is at least this (default 0.5)")
    p.add_argument("--limit", type=int, default=20, help="rows per table (0: all)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=health_command)


def health_command(args, console: Console) -> int:
    try:
        from ckptfmt.analytics.health import health
    except ImportError as exc:
        raise CheckpointError(f"ckptfmt health needs pyarrow ({exc}): pip install 'ckptfmt[analytics]'") from None
    if not 0 < args.zeros <= 1:
        raise CheckpointError(f"--zeros must be a share in (0, 1], not {args.zeros}")
    found = health(args.repo, deep=args.deep, zeros_share=args.zeros)
    if args.json:
        Output(console).json(found.to_json())
        return 1 if found.first_non_finite else 0
    out, limit = Output(console), (args.limit if args.limit > 0 else None)
    steps = [c["step"] for c in found.checkpoints if c["step"] is not None]
    span = f" (steps {min(steps)} to {max(steps)})" if steps else ""
    out.line(f"{found.run}: {counted(len(found.checkpoints), 'checkpoint')}{span}, "
             f"{counted(len(found.group_norms), 'tensor group')}")
    _non_finite(out, found)
    _jumps(out, found, limit)
    _spikes(out, found, limit)
    _unchanged(out, found, limit)
    _zeros(out, found, limit)
    if found.updates is not None:
        _updates(out, found, limit)
    return 1 if found.first_non_finite else 0


def _non_finite(out: Output, found) -> None:
    first = found.first_non_finite
    if first is None:
        out.line("NaN/Inf: none in any checkpoint")
        return
    kinds = (("nan", "NaN"), ("posinf", "+Inf"), ("neginf", "-Inf"))
    tensors = "; ".join(f"{t['key']} ({', '.join(f'{t[k]:,} {label}' for k, label in kinds if t[k])})"
                        for t in first["tensors"][:8])
    more = f"; and {len(first['tensors']) - 8} more" if len(first["tensors"]) > 8 else ""
    later = f"; {counted(len(found.non_finite), 'checkpoint')} hold some" if len(found.non_finite) > 1 else ""
    out.line(f"NaN/Inf: first in {first['checkpoint']} (step {first['step']}): {tensors}{more}{later}")


def _jumps(out: Output, found, limit: int | None) -> None:
    if not found.jumps:
        out.line(f"norm jumps: none (a group's norm changing {found.rules['jump_factor']}x or more, far off its "
                 "own trend)")
        return
    columns = [Column("group", KEY), Column("checkpoint", NAME), Column("step", right=True),
               Column("norm", right=True), Column("change", right=True)]
    out.table(f"norm jumps ({len(found.jumps)}: a group's norm off its trend)", columns, (
        (j["group"], j["checkpoint"], str(j["step"]), number(j["norm"]), f"x{j['factor']:.3g}")
        for j in found.jumps[:limit]))


def _spikes(out: Output, found, limit: int | None) -> None:
    if not found.metric_spikes:
        out.line("metric spikes: none")
        return
    columns = [Column("metric", KEY), Column("steps", right=True), Column("peak", right=True),
               Column("baseline", right=True), Column("between checkpoints", TEXT)]
    out.table(f"metric spikes ({len(found.metric_spikes)})", columns, (
        (s["metric"], str(s["first_step"]) if s["first_step"] == s["last_step"]
         else f"{s['first_step']}-{s['last_step']}", "NaN" if s["non_finite"] else number(s["peak"]),
         number(s["baseline"]), f"{s['after'] or 'start'} and {s['before'] or 'the next'}")
        for s in found.metric_spikes[:limit]))


def _unchanged(out: Output, found, limit: int | None) -> None:
    if not found.unchanged:
        out.line("unchanged tensors: none")
        return
    columns = [Column("tensor", KEY), Column("since", NAME), Column("checkpoints", right=True),
               Column("by", right=True)]
    out.table(f"unchanged tensors ({len(found.unchanged)}: frozen, or no gradient reaches them)", columns, (
        (u["key"], u["since"], str(u["checkpoints"]), u["evidence"]) for u in found.unchanged[:limit]))


def _zeros(out: Output, found, limit: int | None) -> None:
    if not found.mostly_zeros:
        out.line(f"mostly zeros: none at {found.rules['zeros_share']:.0%} or more")
        return
    columns = [Column("tensor", KEY), Column("checkpoint", NAME), Column("zeros", right=True),
               Column("of", right=True)]
    out.table(f"mostly zeros ({len(found.mostly_zeros)})", columns, (
        (z["key"], z["checkpoint"], f"{z['share']:.1%}", f"{z['count']:,}") for z in found.mostly_zeros[:limit]))


def _updates(out: Output, found, limit: int | None) -> None:
    """Per group, how far its tensors moved between consecutive checkpoints: ||dW|| / ||W|| (median, last)."""
    by_group: dict[str, dict[str, list[float]]] = {}
    for update in found.updates:
        if update["moved_l2"] is None or update["l2"] is None:
            continue
        group = by_group.setdefault(update["group"], {})
        squares = group.setdefault(update["checkpoint"], [0.0, 0.0])
        squares[0] += update["moved_l2"] ** 2
        squares[1] += update["l2"] ** 2
    rows = []
    for name, checkpoints in sorted(by_group.items()):
        ratios = [math.sqrt(moved / total) for moved, total in checkpoints.values() if total > 0]
        if ratios:
            rows.append((name, number(sorted(ratios)[len(ratios) // 2]), number(ratios[-1]),
                         short(list(checkpoints)[-1], 40)))
    if not rows:
        out.line("updates: no tensor changed between checkpoints")
        return
    columns = [Column("group", KEY), Column("median", right=True), Column("last", right=True),
               Column("at", NAME)]
    out.table("relative updates ||W_t - W_prev|| / ||W_t|| per group", columns, rows[:limit])
