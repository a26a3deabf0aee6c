"""The analysis commands that need ``ckptfmt.analytics`` (pyarrow): ``analytics export``, ``stragglers``,
``compare``, ``certify``, ``goodput`` and ``report``. Each imports the analytics when it runs."""

from __future__ import annotations

import argparse
import dataclasses

from rich.console import Console

from ckptfmt.cli.shared import found
from ckptfmt.errors import CheckpointError
from ckptfmt.tools.formatting import counted, number, seconds, text, words, world_sizes
from ckptfmt.tools.output import KEY, NAME, TEXT, Column, Output


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``analytics export``, ``stragglers``, ``compare``, ``certify``, ``goodput`` and ``report`` to the
    ``ckptfmt`` parser."""
    p = subparsers.add_parser("analytics", help="a run's metadata as tables (needs ckptfmt[analytics])")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    e = actions.add_parser("export", help="write the tables of spec/ANALYTICS.md as Parquet or CSV files")
    e.add_argument("repo", help="repository URL")
    e.add_argument("out", help="folder for checkpoints.parquet, saves.parquet, steps.parquet, ...")
    e.add_argument("--format", choices=["parquet", "csv"], default="parquet")
    e.add_argument("--append", action="store_true",
                   help="add the checkpoints not exported yet to a run-partitioned Parquet dataset: "
                        "OUT/<table>/run=LABEL/part-N.parquet (reads only their manifests)")
    e.add_argument("--run", dest="label", metavar="LABEL", default=None,
                   help="with --append: the run's label (default: the repository's folder name)")
    e.set_defaults(run=analytics_export_command)

    p = subparsers.add_parser("stragglers", help="ranks that delayed the others, and slow saves (needs "
                                                 "ckptfmt[analytics])")
    p.add_argument("repo", help="repository URL of one run")
    _min_delay_option(p)
    p.add_argument("--explain", action="store_true",
                   help="say why each rank straggled (data loading, CPU contention, memory, GPU, storage) from "
                        "its system samples and save phases, and what to do")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=stragglers_command)

    p = subparsers.add_parser("compare", help="compare two runs: identical? where they diverge, and why (needs "
                                              "ckptfmt[analytics])")
    p.add_argument("a", help="repository URL of one run")
    p.add_argument("b", help="repository URL of the other")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance for equal tensors")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance for equal tensors")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=compare_command)
    _register_runs(subparsers)


def _register_runs(subparsers: argparse._SubParsersAction) -> None:
    """``certify``, ``goodput`` and ``report``: what a run reproduces, where its time went, its report."""
    p = subparsers.add_parser("certify", help="does RUN reproduce REFERENCE bit for bit? If not, from which step "
                                              "and why; with REFERENCE alone, each of its resumes (needs "
                                              "ckptfmt[analytics])")
    p.add_argument("reference", help="repository URL of the reference run (alone: the run whose resumes to certify)")
    p.add_argument("candidate", metavar="run", nargs="?", default=None,
                   help="repository URL of the run to certify against it")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=certify_command)

    p = subparsers.add_parser("goodput", help="where a run's wall time went: productive steps, data waits, save "
                                              "stalls, restarts, steps computed again, straggler waits (needs "
                                              "ckptfmt[analytics])")
    p.add_argument("repo", help="repository URL of the run")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=goodput_command)

    p = subparsers.add_parser("report", help="a run's figures and tables as one self-contained HTML file and/or "
                                             "PNGs (needs ckptfmt[analytics])")
    p.add_argument("repo", help="repository URL of the run")
    p.add_argument("--compare", metavar="REPO_B", default=None, help="a second run to compare it with")
    p.add_argument("--html", metavar="OUT.html", default=None, help="write the page here")
    p.add_argument("--png", metavar="DIR", default=None, help="write each figure as DIR/<figure>.png")
    p.add_argument("--deep", action="store_true", help="add each tensor group's relative update between "
                                                       "checkpoints (reads the tensors that changed)")
    _min_delay_option(p)
    p.set_defaults(run=report_command)


def _min_delay_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--min-delay", type=float, default=None, metavar="SECONDS",
                        help="report no delay shorter than this (default 0.01; raise it where the OS deschedules "
                             "ranks for longer, as on oversubscribed machines)")


def analytics_export_command(args, console: Console) -> int:
    analytics = _analytics()
    if args.append:
        return _append(analytics, args, console)
    if args.label is not None:
        raise CheckpointError("--run LABEL labels a run of a dataset: it goes with --append")
    built = analytics.tables(args.repo)
    paths = analytics.export(built, args.out, args.format)
    columns = [Column("table"), Column("rows", right=True), Column("columns", right=True), Column("file", NAME)]
    Output(console).table(f"{args.repo}: {counted(built['checkpoints'].num_rows, 'checkpoint')}", columns, (
        (name, number(data.num_rows), number(data.num_columns), str(path))
        for (name, data), path in zip(built.items(), paths)))
    return 0


def _append(analytics, args, console: Console) -> int:
    if args.format != "parquet":
        raise CheckpointError("--append writes a Parquet dataset: --format csv does not go with it")
    from ckptfmt.analytics.dataset import default_label

    label = args.label or default_label(args.repo)
    appended = analytics.export_incremental({label: args.repo}, args.out)
    out = Output(console)
    out.table(f"run {label}: {counted(appended.read, 'checkpoint')} read, {number(appended.skipped)} exported "
              "before", [Column("table"), Column("rows added", right=True)],
              ((name, number(rows)) for name, rows in appended.rows.items()))
    return 0


def stragglers_command(args, console: Console) -> int:
    analytics = _analytics()
    thresholds = _thresholds(args)
    report = analytics.stragglers(args.repo, thresholds=thresholds, explain=args.explain)
    if args.json:
        Output(console).json(report.to_json())
        return found(report.stragglers or report.slow_saves)
    out = Output(console)
    out.line(f"{args.repo}: {counted(report.steps, 'step')} of {counted(report.ranks, 'rank')}")
    if report.stragglers:
        columns = [Column("rank", right=True), Column("host", NAME), Column("kind"), Column("steps", TEXT),
                   Column("phase", NAME), *(Column(header, right=True) for header in ("delay", "worst", "x median"))]
        out.table(f"{counted(len(report.stragglers), 'straggler')} (delays in a rank's own phases, beyond the "
                  "jitter)", columns, (
                      (str(s.rank), text(s.host), s.kind, analytics.episode_ranges(s.episodes), s.phase,
                       seconds(s.delay_s), seconds(s.max_delay_s), _times(s.ratio)) for s in report.stragglers))
    else:
        out.line(f"no stragglers found: no rank was delayed in its own phases by {seconds(thresholds.floor_s)} "
                 "or more beyond the jitter")
    if report.hosts:
        columns = [Column("host", KEY), Column("slow ranks", TEXT), Column("steps", TEXT),
                   Column("delay", right=True)]
        out.table("hosts with several slow ranks at once", columns, (
            (text(h.host), f"{', '.join(map(str, h.ranks))} of {h.of_ranks}", _ranges(h.steps), seconds(h.delay_s))
            for h in report.hosts))
    if report.slow_saves:
        columns = [Column("rank", right=True), Column("host", NAME), Column("checkpoints", TEXT),
                   Column("phases", TEXT), Column("delay", right=True), Column("x median", right=True)]
        out.table("slow saves (a rank's own save phases lagging the others')", columns, (
            (str(e.rank), text(e.host), ", ".join(e.checkpoints), ", ".join(sorted(set(e.phases))),
             seconds(e.delay_s), _times(e.ratio)) for e in report.slow_saves))
    if any(entry.ratio is None for entry in [*report.stragglers, *report.slow_saves]):
        out.line(f"x median {_times(None)}: the phase's median is too short to compare with")
    if args.explain and report.explanations:
        columns = [Column("rank", right=True), Column("steps", right=True), Column("cause", NAME),
                   Column("evidence", TEXT), Column("what to do", TEXT)]
        out.table("why they straggled", columns, (
            (str(e["rank"]), _ranges(list(range(e["first_step"], e["last_step"] + 1))), c["cause"], c["evidence"],
             c["action"]) for e in report.explanations for c in e["causes"]))
    return found(report.stragglers or report.slow_saves)


def _thresholds(args):
    """The straggler thresholds the command line asks for."""
    thresholds = _analytics().Thresholds()
    if args.min_delay is None:
        return thresholds
    if not args.min_delay >= 0:
        raise CheckpointError(f"--min-delay must be 0 or more seconds, not {args.min_delay}")
    return dataclasses.replace(thresholds, floor_s=args.min_delay)


def report_command(args, console: Console) -> int:
    if args.html is None and args.png is None:
        raise CheckpointError("say where the report goes: --html OUT.html and/or --png DIR")
    _analytics()
    try:
        from ckptfmt.analytics.report import report as write_report
    except ImportError as exc:
        raise CheckpointError(f"ckptfmt report needs matplotlib ({exc}): pip install 'ckptfmt[analytics]'") from None
    made = write_report(args.repo, html_path=args.html, png_dir=args.png, compare_with=args.compare,
                        thresholds=_thresholds(args), deep=args.deep)
    out = Output(console)
    for where in (args.html, args.png):
        if where is not None:
            out.line(f"wrote {where} ({counted(len(made.figures), 'figure')}: {', '.join(made.figures)})")
    return 0


def compare_command(args, console: Console) -> int:
    report = _analytics().compare(args.a, args.b, atol=args.atol, rtol=args.rtol)
    if args.json:
        Output(console).json(report.to_json())
        return found(not report.identical)
    out = Output(console)
    tolerance = f" within atol {args.atol:g}, rtol {args.rtol:g}" if args.atol or args.rtol else " bit for bit"
    verdict = "identical" + tolerance if report.identical else "different"
    out.line(f"{args.a} vs {args.b}: {counted(len(report.checkpoints), 'checkpoint')} at common steps; "
             f"the runs are {verdict}")
    for side, steps in (("a", report.steps_only_in_a), ("b", report.steps_only_in_b)):
        if steps:
            out.line(f"steps saved only in {side}: {_ranges(steps)}")
    divergence = report.first_divergence
    if divergence:
        amount = "" if divergence.max_abs is None or divergence.max_rel is None else \
            f": max abs difference {divergence.max_abs:.3g}, max relative {divergence.max_rel:.3g}"
        out.line(f"first divergence: step {divergence.step} ({divergence.checkpoint}), tensor "
                 f"{divergence.tensor}{amount}")
    columns = [Column("field", KEY), Column("kind"), Column("rank", right=True), Column("a", TEXT),
               Column("b", TEXT), Column("from step", right=True), Column("evidence", TEXT)]
    for explains, title in ((True, "that could explain it"), (False, "that cannot explain it")):
        shown = [d for d in report.differences if d.explains is explains]
        if shown:
            out.table(f"{counted(len(shown), 'recorded difference')} {title}", columns, (
                (d.field, d.kind, words(d.rank), words(d.a), words(d.b), words(d.first_step), words(d.evidence))
                for d in shown))
    return found(not report.identical)


def certify_command(args, console: Console) -> int:
    """Exit 0: reproduces; 1: diverges; 2: cannot tell (the missing record named)."""
    from ckptfmt.analytics.certify import EXIT_CODES

    result = _analytics().certify(args.reference, args.candidate)
    certificates = result if isinstance(result, list) else [result]
    if args.json:
        Output(console).json(certificates[0].to_json() if not isinstance(result, list)
                             else [c.to_json() for c in certificates])
        return _worst(certificates, EXIT_CODES)
    out = Output(console)
    if isinstance(result, list) and not certificates:
        out.line(f"{args.reference}: no resume on record; nothing to certify")
        return EXIT_CODES["undetermined"]
    if not isinstance(result, list):
        out.line(f"reference: {result.reference}")
        out.line(f"run: {result.run}")
    else:
        out.line(f"run: {args.reference}")
    for certificate in certificates:
        if isinstance(result, list):
            out.line(f"resume from {certificate.resumed_from}")
        out.line(f"verdict: {certificate.verdict} over {counted(certificate.steps_compared, 'common step')}")
        divergence = certificate.first_divergence
        if divergence is not None:
            ranks = ", ".join(map(str, divergence["ranks"])) or "-"
            out.line(f"first divergence: step {divergence['step']}, ranks {ranks}, cause {divergence['cause']}")
            for line in divergence["evidence"]:  # reference vs run
                out.line(f"  {line}")
            for cause in certificate.causes[1:]:
                out.line(f"also possible: {cause.cause}")
                for line in cause.evidence[:3]:
                    out.line(f"  {line}")
        if certificate.missing:
            out.line(f"cannot tell: {certificate.missing}")
    return _worst(certificates, EXIT_CODES)


def goodput_command(args, console: Console) -> int:
    from ckptfmt.analytics.goodput import CATEGORY_NAMES

    result = _analytics().goodput(args.repo)
    if args.json:
        Output(console).json(result.to_json())
        return 0
    out = Output(console)
    if not result.ranks:
        out.line(f"{args.repo}: no training steps on record (a StepTimer handed to the saves)")
        return 2
    out.line(f"run: {args.repo}")
    out.line(f"{seconds(result.wall_s)} of wall time on {counted(result.ranks, 'rank')}, "
             f"{counted(result.steps_kept, 'step')} kept, {result.steps_recomputed} computed again")
    shares = result.shares
    out.table("where the time went (the mean of the ranks)",
              [Column("share"), Column("time", right=True), Column("of wall", right=True)],
              ((CATEGORY_NAMES[name], seconds(value), f"{shares[name]:.1%}")
               for name, value in result.seconds.items()))
    if result.restarts:
        out.table(counted(len(result.restarts), "restart"),
                  [Column("rank", right=True), Column("resumed from", NAME), Column("step", right=True),
                   Column("down", right=True), Column("world size", right=True)],
                  ((words(r["rank"]), words(r["from"]), words(r["from_step"]), seconds(r["seconds"]),
                    world_sizes(r["world_size"])) for r in result.restarts))
    return 0


def _worst(certificates: list, codes: dict[str, int]) -> int:
    return max((codes[c.verdict] for c in certificates), default=codes["undetermined"])


def _ranges(steps: list[int]) -> str:
    """Step numbers as ranges: 3, 5-9."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.1f}x"


def _analytics():
    """ckptfmt.analytics, or a one-line error naming the extra that brings pyarrow."""
    try:
        import ckptfmt.analytics.tables  # noqa: F401 (pyarrow: the package's names load on first use)
        from ckptfmt import analytics
    except ImportError as exc:
        raise CheckpointError(f"ckptfmt analytics needs pyarrow ({exc}): pip install 'ckptfmt[analytics]'") from None
    return analytics
