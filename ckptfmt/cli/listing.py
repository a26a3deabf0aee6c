"""``ckptfmt ls``: a repository's checkpoints, from their commit records alone: no manifest is parsed, so
neither numpy nor torch is loaded; and the space parity takes, from one listing of ``_parity/``."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rich.console import Console

from ckptfmt.tools.formatting import counted, human_bytes, human_time, text
from ckptfmt.tools.output import KEY, NAME, Column, Output

if TYPE_CHECKING:
    from ckptfmt.repository.repository import CommitRecord


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``ls`` command to the ``ckptfmt`` parser."""
    p = subparsers.add_parser("ls", help="list a repository's checkpoints")
    p.add_argument("repo", help="repository URL (local path, s3://, memory://)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=ls_command)


def ls_command(args, console: Console) -> int:
    from ckptfmt.format import layout  # the command's work, imported when it runs: CLI startup
    from ckptfmt.repository.pointers import POINTER_SUFFIX, pointers
    from ckptfmt.repository.repository import Repository

    repo = Repository.open(args.repo)
    records = repo.commits()
    names = {r.name for r in records}
    pointed = pointers(repo.storage, [e for e in repo.storage.list("") if e.endswith(POINTER_SUFFIX)])
    if args.json:
        Output(console).json([{
            **r.totals, "name": r.name, "step": r.step, "created_ns": r.created_ns, "parent": r.parent,
            "parent_exists": r.parent is None or r.parent in names, "manifest": r.manifest_hash,
            "pointers": pointed.get(r.name, []),
        } for r in records])
        return 0
    columns = [Column("name", KEY), Column("step", right=True), Column("created"), Column("size", right=True),
               Column("new bytes", right=True), Column("parent", NAME)]
    parity = repo.storage.find(layout.PARITY_DIR)  # one listing: what parity (spec 5.6) adds to the space
    space = f"; parity {human_bytes(sum(parity.values()))} in {counted(len(parity), 'object')}" if parity else ""
    Output(console).table(f"{repo.url}: {counted(len(records), 'checkpoint')}{space}", columns, (
        (_listed_name(r, pointed), text(r.step), human_time(r.created_ns),
         human_bytes(r.totals.get("stored_bytes")), human_bytes(r.totals.get("new_bytes")),
         "-" if r.parent is None else r.parent if r.parent in names else f"{r.parent} (removed)")
        for r in records))
    return 0


def _listed_name(record: CommitRecord, pointed: dict[str, list[str]]) -> str:
    """A checkpoint's name, with the paths that point at it (Lightning's ``last.ckpt``): 'last-4 (last.ckpt)',
    and the nodes a node-scoped checkpoint's chunks are spread over (spec 9.8): 'step-8 (2 nodes)'."""
    notes = list(pointed.get(record.name, []))
    nodes = record.totals.get("nodes")
    if type(nodes) is int:
        notes.append(counted(nodes, "node"))
    return f"{record.name} ({', '.join(notes)})" if notes else record.name
