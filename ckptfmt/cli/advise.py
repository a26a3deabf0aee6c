"""``ckptfmt advise REPO [--mtbf 8h] [--json]``: how often to checkpoint, from the run's own timing."""

from __future__ import annotations

import argparse
import math
import re
from typing import TYPE_CHECKING

from rich.console import Console

from ckptfmt.tools.output import Column, Output

if TYPE_CHECKING:
    from ckptfmt.lifecycle.advise import Plan

#: Seconds per duration unit; a bare number is seconds.
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd]?)\s*", re.IGNORECASE)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``advise`` command to the ``ckptfmt`` parser."""
    p = subparsers.add_parser("advise", help="how often to checkpoint: Young's and Daly's intervals from the "
                                             "run's measured save stall and step time")
    p.add_argument("repo", help="repository URL of one run")
    p.add_argument("--mtbf", type=parse_duration, default=parse_duration("8h"), metavar="DURATION",
                   help="the job's mean time between failures: 90s, 30m, 8h, 2d or seconds (default 8h)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=advise_command)


def parse_duration(value: str) -> float:
    """'90s', '30m', '8h', '2d' or plain seconds ('3600', '1.5h') as positive seconds."""
    match = _DURATION.fullmatch(value)
    seconds = float(match[1]) * _UNITS[match[2].lower()] if match else math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive duration (90s, 30m, 8h, 2d or seconds)")
    return seconds


def advise_command(args, console: Console) -> int:
    """Print the advice for ``args.repo`` as a table, or as JSON with ``args.json``."""
    from ckptfmt.lifecycle.advise import advise  # the command's work, imported when it runs: CLI startup

    advice = advise(args.repo, mtbf=args.mtbf)
    if args.json:
        Output(console).json(advice.to_dict())
        return 0
    background = f", background write {duration(advice.background_s)}" if advice.asynchronous else ""
    out = Output(console)
    out.line(f"{advice.repo}: {advice.saves} saves measured ({advice.asynchronous} asynchronous), "
             f"MTBF {duration(advice.mtbf_s)}")
    out.line(f"save stall {duration(advice.stall_s)} (median, slowest rank){background}; step time "
             f"{duration(advice.step_s)} (from {advice.step_source})")
    columns = [Column("interval"), *(Column(header, right=True)
                                     for header in ("steps", "time", "overhead", "lost per failure"))]
    out.table("checkpoint interval", columns, (
        (label, *_cells(plan)) for label, plan in (("actual", advice.actual), ("Young", advice.young),
                                                   ("Daly (advice)", advice.daly))))
    out.line()
    out.line(f"Save every {advice.daly.steps} steps (Daly): {_ratio(advice.checkpoints_ratio)}; expected "
             f"overhead {_percent(advice.actual.overhead)} -> {_percent(advice.daly.overhead)}.")
    return 0


def _cells(plan: Plan) -> tuple[str, ...]:
    return (str(plan.steps), duration(plan.interval_s), _percent(plan.overhead), duration(plan.lost_per_failure_s))


def _ratio(ratio: float) -> str:
    """How the advised number of checkpoints compares with the run's."""
    if math.isclose(ratio, 1.0, rel_tol=0.05):
        return "about as many checkpoints as now"
    if ratio > 1:
        return f"{ratio:.1f}x as many checkpoints as now"
    return f"{1 / ratio:.1f}x fewer checkpoints than now"


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.2f} %"


def duration(value: float) -> str:
    """Seconds in the unit that reads best: '85.0 ms', '42.0 s', '12.5 min', '8.0 h', '2.0 d'."""
    for limit, unit, size in ((1, "ms", 1e-3), (120, "s", 1), (7200, "min", 60), (172800, "h", 3600)):
        if value < limit:
            return f"{value / size:.1f} {unit}"
    return f"{value / 86400:.1f} d"

