"""``ckptfmt show``: one checkpoint's tensors, metadata and signatures, from its manifest (no torch:
``loading/checkpoint.py``)."""

from __future__ import annotations

import argparse
import fnmatch
import json

from rich.console import Console

from ckptfmt.cli.shared import SHOW_LIMIT, jsonable
from ckptfmt.tools.formatting import human_bytes, human_time, seconds, shape_text, short
from ckptfmt.tools.output import KEY, TEXT, Column, Output


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``show`` command to the ``ckptfmt`` parser."""
    p = subparsers.add_parser("show", help="show a checkpoint's tensors and metadata")
    p.add_argument("checkpoint", help="checkpoint URL REPO/NAME, or a repository for its latest")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--limit", type=int, default=None,
                   help=f"tensors to list (0: all; default: {SHOW_LIMIT} in a terminal, all into a pipe)")
    p.add_argument("--filter", metavar="PATTERN", default=None,
                   help="only the tensors whose key holds PATTERN (a glob if it has * ? or [: 'model/*/weight')")
    p.set_defaults(run=show_command)


def show_command(args, console: Console) -> int:
    from ckptfmt.loading.checkpoint import Checkpoint  # the command's work, imported when it runs: CLI startup
    from ckptfmt.tools import describe

    with Checkpoint.open(args.checkpoint) as ckpt:
        meta = ckpt.metadata
        tensors = [ckpt.tensor_info(k) for k in ckpt.keys()]
        stats = [ckpt.tensor_stats(k) for k in ckpt.keys()]
        deltas = set(describe.delta_tensors(ckpt.manifest))
        signed = _signatures(ckpt)
        if args.json:
            Output(console).json(jsonable({
                "url": ckpt.url, "id": ckpt.id, **meta, "signatures": signed,
                "tensors": [{"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
                             "shards": len(t.shards), "kind": t.kind, "stats": s,
                             "delta_of": ckpt.manifest.parent if t.key in deltas else None}
                            for t, s in zip(tensors, stats)],
            }))
            return 0
        out = Output(console)
        delta = describe.delta_row(ckpt.manifest)
        out.table(None, _LABELLED, describe.summary(meta, ckpt.url, ckpt.id) + ([delta] if delta else []) +
                  [("signed", _signed_text(signed))], header=False)
        _show_tensors(out, tensors, stats, args, ckpt.keys())
        out.table("metadata", _LABELLED, _metadata_rows(meta), header=False)
    return 0


def _signatures(ckpt) -> list[dict]:
    """The checkpoint's signature objects (spec 10.3): key id, signer, when, and whether each signs this
    checkpoint under its own key (who to trust is ``verify --trusted-key``'s question)."""
    from ckptfmt.repository.signatures import signatures

    found = []
    for entry in signatures(ckpt.repository, ckpt.name):
        sig = entry.signature
        found.append({"key": entry.key, "key_id": sig.key_id if sig else None, "signer": sig.signed_by if sig else None,
                      "created_ns": sig.created_ns if sig else None,
                      "intact": sig is not None and sig.verifies(ckpt.commit), "damage": entry.damage})
    return found


def _signed_text(signed: list[dict]) -> str:
    if not signed:
        return "no (ckptfmt sign adds a signature)"
    return "; ".join(f"key {s['key_id']} by {s['signer'] or '?'}, {human_time(s['created_ns'])}"
                     + ("" if s["intact"] else ": DOES NOT VERIFY (forged or damaged)")
                     if s["key_id"] else f"{s['key']}: unreadable" for s in signed)


#: Label and value: the summary and metadata of ``show``.
_LABELLED = (Column("label", style="bold"), Column("value", TEXT))


def _show_tensors(out: Output, tensors: list, stats: list, args, keys: list[str]) -> None:
    """The tensor table: what each tensor is and, where recorded, what its values look like (spec 6.10);
    a shards column only when some tensor has several. Every column but the key fits 100 columns.
    ``--filter`` keeps the tensors whose key matches; a terminal lists SHOW_LIMIT of them unless
    ``--limit`` says otherwise, and says so; a pipe lists every one (a grep must find what is there)."""
    from ckptfmt.tools import describe

    rows = [(t, s) for t, s in zip(tensors, stats) if args.filter is None or _matches(t.key, args.filter)]
    if args.filter is not None and not rows:
        import difflib  # only for a filter that matches nothing: not at every CLI start

        near = difflib.get_close_matches(args.filter, keys, n=3)
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        out.line(f"no tensor key matches {args.filter!r}{hint}")
        return
    limit = args.limit if args.limit is not None else (SHOW_LIMIT if out.terminal else 0)
    shown = rows if limit <= 0 else rows[:limit]
    sharded = any(len(t.shards) > 1 for t, _ in shown)
    columns = [Column("key", KEY), Column("dtype"), Column("shape"), Column("size", right=True)]
    columns += [Column("shards", right=True)] * sharded
    columns += [Column(name, right=True) for name in ("mean", "l2", "absmax", "nan/inf", "zeros")]
    matching = f" matching {args.filter!r}" if args.filter is not None else ""
    out.table(f"tensors{matching} ({len(shown)} of {len(rows)})", columns, (
        (t.key, t.dtype, shape_text(t.shape), human_bytes(t.nbytes), *[str(len(t.shards))] * sharded,
         *describe.stats_cells(s)) for t, s in shown))
    if len(shown) < len(rows):
        out.line(f"{len(rows) - len(shown)} more: --limit 0 lists every tensor, --filter PATTERN some of them "
                 "(into a pipe, every tensor is listed)")


def _matches(key: str, pattern: str) -> bool:
    """A glob when the pattern has wildcards, else a substring: as a user filters keys."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(key, pattern)
    return pattern in key


def _metadata_rows(meta: dict) -> list[tuple[str, str]]:
    """Environment, RNG, topology, timing and user metadata, whatever their types (spec section 9)."""
    from ckptfmt.tools import describe

    rows = describe.environment(meta)
    rows += [(f"rng rank {row.rank}", f"{row.generators}; torch seed {row.torch_seed}") for row in describe.rng(meta)]
    topology = dict(describe.topology(meta))
    hosts = ", ".join(f"{r.rank}@{r.host}" for r in describe.ranks(meta)) or "-"
    rows.append(("topology", f"world size {topology['world size']}, parallelism {topology['parallelism']}, "
                             f"ranks {hosts}"))
    for timing in describe.save_timing(meta):
        phases = ", ".join(f"{name} {seconds(duration)}" for name, duration in timing.phases)
        rows.append((f"save timing rank {timing.rank}", f"{seconds(timing.total_s)}: {phases or '-'}"))
    steps = describe.step_summary(meta)
    if steps:
        rows.append(("step times", steps))
    found = describe.replicas(meta)
    if found:
        rows.append(("replicas", found))
    spread = describe.placement(meta)
    if spread:
        rows.append(("placement", spread))
    rows.append(("user", short(json.dumps(jsonable(meta.get("user"))), 500)))
    return rows
