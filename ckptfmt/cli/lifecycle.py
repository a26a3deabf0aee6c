"""``ckptfmt rm REPO/NAME...`` and ``ckptfmt gc REPO``: delete checkpoints, reclaim their space;
``ckptfmt repair REPO [--from OTHER]``: replace damaged objects with verified copies or rebuild them from
parity; ``ckptfmt protect URL --parity K+M``: add that parity. Each command
imports its work when it runs, so that building the parser stays cheap for every command."""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import TYPE_CHECKING

from rich.console import Console

from ckptfmt.cli.advise import parse_duration
from ckptfmt.errors import CheckpointError
from ckptfmt.tools.formatting import counted, human_bytes, seconds
from ckptfmt.tools.output import KEY, NAME, TEXT, Column, Output

if TYPE_CHECKING:
    from ckptfmt.lifecycle.gc import GcReport
    from ckptfmt.lifecycle.repair import RepairReport
    from ckptfmt.repository.repository import Repository


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("rm", help="delete checkpoints (their chunks go at the next gc)")
    p.add_argument("checkpoints", nargs="+", metavar="REPO/NAME", help="checkpoint URLs, all in one repository")
    p.set_defaults(run=rm_command)

    p = subparsers.add_parser("gc", help="apply retention rules, then reclaim what no checkpoint references; "
                                         "safe while saves run")
    p.add_argument("repo", help="repository URL")
    p.add_argument("--dry-run", action="store_true", help="report what would be deleted, delete nothing")
    p.add_argument("--keep-last", type=int, metavar="N", help="keep the newest N checkpoints")
    p.add_argument("--keep-every", type=int, metavar="K", help="keep checkpoints whose step is a multiple of K")
    p.add_argument("--keep-best", metavar="METRIC:min|max:N",
                   help="keep the N best checkpoints by a metric the manager stored (e.g. val_loss:min:3)")
    p.add_argument("--keep-within", type=parse_duration, metavar="DURATION",
                   help="keep checkpoints younger than this (90s, 30m, 8h, 2d)")
    p.add_argument("--wait", type=parse_duration, default=60.0, metavar="DURATION",
                   help="how long to wait for running saves before giving up the sweep (default 60s)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=gc_command)

    p = subparsers.add_parser("repair", help="replace missing or damaged chunks, manifests and commit records "
                                             "with verified copies from other repositories, or rebuild them "
                                             "from parity")
    p.add_argument("repo", help="repository URL")
    p.add_argument("--from", dest="sources", action="append", default=[], metavar="OTHER",
                   help="a repository holding copies (another tier, a replica); repeatable, tried in order, "
                        "before parity")
    p.add_argument("--dry-run", action="store_true", help="report what would be repaired, write nothing")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=repair_command)

    p = subparsers.add_parser("protect", help="add Reed-Solomon parity to a checkpoint or every checkpoint of a "
                                              "repository: repair then rebuilds lost objects with no replica")
    p.add_argument("url", help="checkpoint or repository URL")
    p.add_argument("--parity", default="8+2", metavar="K+M",
                   help="K data pieces and M parity pieces a stripe: any M lost per stripe rebuild (default 8+2)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=protect_command)



def rm_command(args, console: Console) -> int:
    from ckptfmt.lifecycle.gc import remove  # each command's work, imported when it runs: CLI startup
    from ckptfmt.repository.repository import Repository, split_checkpoint_url

    parts = [split_checkpoint_url(url) for url in args.checkpoints]
    repos = {repo for repo, _ in parts}
    if len(repos) > 1:
        raise CheckpointError(f"rm takes checkpoints of one repository at a time, got {len(repos)}: "
                              f"{', '.join(sorted(repos))}")
    repo = Repository.open(repos.pop())
    removed = remove(repo, [name for _, name in parts])
    Output(console).line(f"{repo.url}: removed {counted(len(removed), 'checkpoint')}: {', '.join(removed)}; "
                         "run ckptfmt gc to reclaim their chunks")
    return 0


def gc_command(args, console: Console) -> int:
    from ckptfmt.lifecycle.gc import collect, remove
    from ckptfmt.lifecycle.retention import Retention, metrics_reader
    from ckptfmt.repository.repository import Repository

    repo = Repository.open(args.repo)
    retention = Retention(keep_last=args.keep_last, keep_every=args.keep_every, keep_best=_best(args.keep_best),
                          keep_within=None if args.keep_within is None else timedelta(seconds=args.keep_within))
    doomed = [r.name for r in retention.to_delete(repo.commits(), metrics_reader(repo))]
    if doomed and not args.dry_run:
        remove(repo, doomed)
    report = collect(repo, dry_run=args.dry_run, wait_s=args.wait,
                     assume_removed=frozenset(doomed) if args.dry_run else frozenset())
    if args.json:
        Output(console).json({"checkpoints": doomed, **report.to_dict()})
    else:
        Output(console).line(_summary(repo, doomed, report))
    return 0 if report.swept or args.dry_run else 1


def _best(text: str | None) -> tuple[str, str, int] | None:
    if text is None:
        return None
    metric, _, rest = text.rpartition(":")
    metric, _, mode = metric.rpartition(":")
    try:
        from ckptfmt.lifecycle.retention import Retention

        return Retention(keep_best=(metric, mode, int(rest))).keep_best
    except ValueError:
        raise CheckpointError(f"--keep-best {text!r}: expected METRIC:min|max:N, e.g. val_loss:min:3") from None


def _summary(repo: Repository, doomed: list[str], report: GcReport) -> str:
    verb = "would free" if report.dry_run else "freed"
    removed = f"{'would remove' if report.dry_run else 'removed'} {counted(len(doomed), 'checkpoint')}" + (
        f" ({', '.join(doomed[:5])}{', ...' if len(doomed) > 5 else ''})" if doomed else "")
    if report.busy:
        return (f"{repo.url}: {removed}; no chunk deleted: held back by {counted(len(report.busy), 'live save lease')}"
                f" (a running save, or a killed one's until it expires): {'; '.join(report.busy)}; run gc again then")
    parity = f", {counted(report.parity, 'parity object')}" if report.parity else ""
    freed = (f"{verb} {human_bytes(report.chunk_bytes + report.parity_bytes + report.other_bytes)}: "
             f"{counted(report.chunks, 'unreferenced chunk')}{parity} and {counted(report.other, 'other file')} "
             "(manifests and leftovers of removed or failed saves)")
    kept_parity = f" and {human_bytes(report.kept_parity_bytes)} of parity" if report.kept_parity else ""
    return (f"{repo.url}: {removed}; {freed}; {counted(report.kept_chunks, 'chunk')}, "
            f"{human_bytes(report.kept_bytes)}{kept_parity} kept for the remaining checkpoints")


def repair_command(args, console: Console) -> int:
    from ckptfmt.cli.render import ByteProgress
    from ckptfmt.lifecycle.repair import repair

    with ByteProgress("checking", quiet=args.json) as progress:
        report = repair(args.repo, args.sources, dry_run=args.dry_run, callback=progress)
    if args.json:
        Output(console).json({
            "ok": report.ok, "dry_run": report.dry_run, "url": report.url, "sources": report.sources,
            "checkpoints": report.checkpoints, "seconds": report.seconds,
            "repaired": [dict(f.__dict__, checkpoints=list(f.checkpoints)) for f in report.fixed],
            "unrepaired": [dict(u.__dict__, tensors=list(u.tensors)) for u in report.unrepaired],
            "verified": None if report.verified is None else report.verified.ok,
        })
        return 0 if report.ok else 1
    out = Output(console)
    out.line(_repair_summary(report))
    if report.fixed:
        out.table("would repair" if report.dry_run else "repaired",
                  [Column("object", KEY), Column("kind"), Column("from", NAME), Column("damage", TEXT)],
                  ((f.key, f.kind, f.source, f.damage) for f in report.fixed))
    if report.unrepaired:
        out.table("not repaired: no good copy, and parity could not rebuild it",
                  [Column("checkpoint", KEY), Column("object", NAME), Column("tensors", NAME),
                   Column("damage and sources", TEXT)],
                  ((u.checkpoint, u.key or "manifest, commit record", "\n".join(u.tensors) or "-",
                    f"{u.damage}; tried: {u.tried}") for u in report.unrepaired))
    if report.verified is not None and not report.verified.ok and not report.unrepaired:
        out.line(f"still damaged after the repair: {report.verified.problems[0].message}")
    return 0 if report.ok else 1


def protect_command(args, console: Console) -> int:
    from ckptfmt.cli.render import ByteProgress
    from ckptfmt.lifecycle.protect import protect

    try:
        with ByteProgress("protecting", quiet=args.json) as progress:
            report = protect(args.url, args.parity, callback=progress)
    except ValueError as exc:  # a K+M the code cannot have
        raise CheckpointError(str(exc)) from None
    if args.json:
        Output(console).json({"url": report.url, "k": report.k, "m": report.m, "seconds": report.seconds,
                              "protected": [p.__dict__ for p in report.protected], "unchanged": report.unchanged})
        return 0
    out = Output(console)
    data = sum(p.stored_bytes for p in report.protected)
    parity = sum(p.parity_bytes for p in report.protected)
    share = f" ({parity / data:.0%} of the data)" if data else ""
    out.line(f"{report.url}: protected {counted(len(report.protected), 'checkpoint')} with parity "
             f"{report.k}+{report.m} in {seconds(report.seconds)}: {human_bytes(parity)} of parity{share}"
             + (f"; {counted(len(report.unchanged), 'checkpoint')} had it already" if report.unchanged else ""))
    if report.protected:
        out.table(None, [Column("checkpoint", KEY), Column("objects", right=True), Column("data", right=True),
                         Column("parity", right=True), Column("stripes", right=True)],
                  ((p.name, str(p.objects), human_bytes(p.stored_bytes), human_bytes(p.parity_bytes), str(p.stripes))
                   for p in report.protected))
    return 0


def _repair_summary(report: RepairReport) -> str:
    checked = f"{report.url}: {counted(len(report.checkpoints), 'checkpoint')} checked in {seconds(report.seconds)}"
    if not report.fixed and not report.unrepaired:
        return f"{checked}: nothing damaged"
    done = (f"{'would repair' if report.dry_run else 'repaired'} {counted(len(report.fixed), 'object')}"
            if report.fixed else "nothing repaired")
    left = f", {counted(len(report.unrepaired), 'problem')} left: no good copy" if report.unrepaired else ""
    verified = "" if report.verified is None else (
        "; the repository verifies" if report.verified.ok else "; the repository still does not verify")
    return f"{checked}: {done}{left}{verified}"
