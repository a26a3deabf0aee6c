"""One function per CLI command: (parsed args, console) -> exit code."""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import json
import warnings
from typing import Any

from rich.console import Console
from rich.text import Text

from ckptfmt.cli.render import ByteProgress
from ckptfmt.errors import CheckpointError, CheckpointWarning, quoted
from ckptfmt.loading.reader import open as open_checkpoint
from ckptfmt.repository.pointers import POINTER_SUFFIX, pointers
from ckptfmt.repository.repository import Repository
from ckptfmt.repository.signatures import signatures
from ckptfmt.tools import describe
from ckptfmt.tools import diff as diff_module
from ckptfmt.tools.describe import text
from ckptfmt.tools.formatting import (
    counted,
    human_bytes,
    human_time,
    number,
    seconds,
    shape_text,
    short,
    words,
)
from ckptfmt.tools.output import KEY, NAME, TEXT, Column, Output
from ckptfmt.tools.verify import verify as verify_url


def ls(args, console: Console) -> int:
    repo = Repository.open(args.repo)
    records = repo.commits()
    names = {r.name for r in records}
    pointed = pointers(repo.storage, [e for e in repo.storage.list("") if e.endswith(POINTER_SUFFIX)])
    if args.json:
        Output(console).json([{
            **r.stats, "name": r.name, "step": r.step, "created_ns": r.created_ns, "parent": r.parent,
            "parent_exists": r.parent is None or r.parent in names, "manifest": r.manifest_hash,
            "pointers": pointed.get(r.name, []),
        } for r in records])
        return 0
    columns = [Column("name", KEY), Column("step", right=True), Column("created"), Column("size", right=True),
               Column("new bytes", right=True), Column("parent", NAME)]
    Output(console).table(f"{repo.url}: {counted(len(records), 'checkpoint')}", columns, (
        (_listed_name(r.name, pointed), text(r.step), human_time(r.created_ns),
         human_bytes(r.stats.get("stored_bytes")), human_bytes(r.stats.get("new_bytes")),
         "-" if r.parent is None else r.parent if r.parent in names else f"{r.parent} (removed)")
        for r in records))
    return 0


def _listed_name(name: str, pointed: dict[str, list[str]]) -> str:
    """A checkpoint's name, with the paths that point at it (Lightning's ``last.ckpt``): 'last-4 (last.ckpt)'."""
    return f"{name} ({', '.join(pointed[name])})" if name in pointed else name


def show(args, console: Console) -> int:
    with open_checkpoint(args.checkpoint) as ckpt:
        meta = ckpt.metadata
        tensors = [ckpt.tensor_info(k) for k in ckpt.keys()]
        stats = [ckpt.tensor_stats(k) for k in ckpt.keys()]
        deltas = set(describe.delta_tensors(ckpt.manifest))
        signed = _signatures(ckpt)
        if args.json:
            Output(console).json(_jsonable({
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
    found = []
    for entry in signatures(ckpt.repository, ckpt.name):
        sig = entry.signature
        found.append({"key": entry.key, "key_id": sig.key_id if sig else None, "signer": sig.signer if sig else None,
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


#: Tensors ``show`` lists in a terminal unless told otherwise (into a pipe: all of them).
SHOW_LIMIT = 50


def _show_tensors(out: Output, tensors: list, stats: list, args, keys: list[str]) -> None:
    """The tensor table: what each tensor is and, where recorded, what its values look like (spec 6.10);
    a shards column only when some tensor has several. Every column but the key fits 100 columns.
    ``--filter`` keeps the tensors whose key matches; a terminal lists SHOW_LIMIT of them unless
    ``--limit`` says otherwise, and says so; a pipe lists every one (a grep must find what is there)."""
    rows = [(t, s) for t, s in zip(tensors, stats) if args.filter is None or _matches(t.key, args.filter)]
    if args.filter is not None and not rows:
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
    rows.append(("user", short(json.dumps(_jsonable(meta.get("user"))), 500)))
    return rows


def verify(args, console: Console) -> int:
    with ByteProgress("verifying", quiet=args.json) as progress:
        report = verify_url(args.url, callback=progress, stats=args.stats, trusted_keys=args.trusted_keys)
    if args.json:
        Output(console).json({
            "ok": report.ok, "checkpoints": report.checkpoints, "chunks_checked": report.chunks_checked,
            "bytes_checked": report.bytes_checked, "seconds": report.seconds,
            **({"stats_checked": report.stats_checked} if args.stats else {}),
            "problems": [p.__dict__ | {"tensors": list(p.tensors)} for p in report.problems],
            "divergences": report.divergences,
            "warnings": report.warnings,
        })
        return 0 if report.ok else 1
    for message in report.warnings:
        warnings.warn(message, CheckpointWarning, stacklevel=1)
    checked = f", statistics of {counted(report.stats_checked, 'tensor')}" if args.stats else ""
    summary = (f"{counted(len(report.checkpoints), 'checkpoint')}, {counted(report.chunks_checked, 'chunk')}, "
               f"{human_bytes(report.bytes_checked)}{checked} in {seconds(report.seconds)}{_rate(report)}")
    out = Output(console)
    if report.ok:
        out.line(Text.assemble(("OK", "green"), f": {summary}"))
        return 0
    out.line(Text.assemble(("DAMAGED", "bold red"), f": {counted(len(report.problems), 'problem')} in {summary}"))
    columns = [Column("checkpoint", KEY), Column("problem"), Column("chunk"), Column("tensors", NAME),
               Column("detail", TEXT)]
    out.table(None, columns, ((p.checkpoint, p.kind, (p.chunk or "-")[:16], "\n".join(p.tensors) or "-", p.message)
                              for p in report.problems))
    return 1


#: Below this much data or time a rate says nothing (a few KiB in a millisecond is not a throughput).
_RATE_FLOOR_BYTES, _RATE_FLOOR_S = 64 * 2**20, 0.05


def _rate(report) -> str:
    """' (2.6 GiB/s)', or nothing where the run was too small to measure a rate."""
    if report.bytes_checked < _RATE_FLOOR_BYTES or report.seconds < _RATE_FLOOR_S:
        return ""
    return f" ({human_bytes(report.bytes_checked / report.seconds)}/s)"


def diff(args, console: Console) -> int:
    report = diff_module.diff(args.a, args.b, measure=args.measure)
    if args.json:
        Output(console).json(_jsonable({
            "a": report.a, "b": report.b,
            "tensors": [t.__dict__ for t in report.tensors],
            "values": [{"key": k, "a": va, "b": vb} for k, va, vb in report.values],
            "metadata": [{"field": f, "a": va, "b": vb} for f, va, vb in report.metadata],
        }))
        return _found(report.differs)
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
    return _found(report.differs)


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


#: Levels of metadata shown as JSON; deeper values (a user value tree may nest 256 deep) are elided.
_JSON_DEPTH = 32


def analytics_export(args, console: Console) -> int:
    analytics = _analytics()
    built = analytics.tables(args.repo)
    paths = analytics.export(built, args.out, args.format)
    columns = [Column("table"), Column("rows", right=True), Column("columns", right=True), Column("file", NAME)]
    Output(console).table(f"{args.repo}: {counted(built['checkpoints'].num_rows, 'checkpoint')}", columns, (
        (name, number(data.num_rows), number(data.num_columns), str(path))
        for (name, data), path in zip(built.items(), paths)))
    return 0


def stragglers(args, console: Console) -> int:
    analytics = _analytics()
    thresholds = _thresholds(args)
    report = analytics.stragglers(args.repo, thresholds=thresholds, explain=args.explain)
    if args.json:
        Output(console).json(report)
        return _found(report["stragglers"] or report["slow_saves"])
    out = Output(console)
    out.line(f"{args.repo}: {counted(report['steps'], 'step')} of {counted(report['ranks'], 'rank')}")
    if report["stragglers"]:
        columns = [Column("rank", right=True), Column("host", NAME), Column("kind"), Column("steps", TEXT),
                   Column("phase", NAME), *(Column(header, right=True) for header in ("delay", "worst", "x median"))]
        out.table(f"{counted(len(report['stragglers']), 'straggler')} (delays in a rank's own phases, beyond the "
                  "jitter)", columns, (
                      (str(s["rank"]), text(s["host"]), s["kind"], analytics.episode_ranges(s["episodes"]),
                       s["phase"], seconds(s["delay_s"]), seconds(s["max_delay_s"]), _times(s["ratio"]))
                      for s in report["stragglers"]))
    else:
        out.line(f"no stragglers found: no rank was delayed in its own phases by {seconds(thresholds.floor_s)} "
                 "or more beyond the jitter")
    if report["hosts"]:
        columns = [Column("host", KEY), Column("slow ranks", TEXT), Column("steps", TEXT),
                   Column("delay", right=True)]
        out.table("hosts with several slow ranks at once", columns, (
            (text(h["host"]), f"{', '.join(map(str, h['ranks']))} of {h['of_ranks']}", _ranges(h["steps"]),
             seconds(h["delay_s"])) for h in report["hosts"]))
    if report["slow_saves"]:
        columns = [Column("rank", right=True), Column("host", NAME), Column("checkpoints", TEXT),
                   Column("phases", TEXT), Column("delay", right=True), Column("x median", right=True)]
        out.table("slow saves (a rank's own save phases lagging the others')", columns, (
            (str(e["rank"]), text(e["host"]), ", ".join(e["checkpoints"]), ", ".join(sorted(set(e["phases"]))),
             seconds(e["delay_s"]), _times(e["ratio"])) for e in report["slow_saves"]))
    if any(entry["ratio"] is None for entry in report["stragglers"] + report["slow_saves"]):
        out.line(f"x median {_times(None)}: the phase's median is too short to compare with")
    if args.explain and report["explanations"]:
        columns = [Column("rank", right=True), Column("steps", right=True), Column("cause", NAME),
                   Column("evidence", TEXT), Column("what to do", TEXT)]
        out.table("why they straggled", columns, (
            (str(e["rank"]), _ranges(list(range(e["first_step"], e["last_step"] + 1))), c["cause"], c["evidence"],
             c["action"]) for e in report["explanations"] for c in e["causes"]))
    return _found(report["stragglers"] or report["slow_saves"])


def _thresholds(args):
    """The straggler thresholds the command line asks for."""
    thresholds = _analytics().Thresholds()
    if args.min_delay is None:
        return thresholds
    if not args.min_delay >= 0:
        raise CheckpointError(f"--min-delay must be 0 or more seconds, not {args.min_delay}")
    return dataclasses.replace(thresholds, floor_s=args.min_delay)


def report(args, console: Console) -> int:
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
            out.line(f"wrote {where} ({counted(len(made['figures']), 'figure')}: {', '.join(made['figures'])})")
    return 0


def compare(args, console: Console) -> int:
    report = _analytics().compare(args.a, args.b, atol=args.atol, rtol=args.rtol)
    if args.json:
        Output(console).json(report)
        return _found(not report["identical"])
    out = Output(console)
    tolerance = f" within atol {args.atol:g}, rtol {args.rtol:g}" if args.atol or args.rtol else " bit for bit"
    verdict = "identical" + tolerance if report["identical"] else "different"
    out.line(f"{args.a} vs {args.b}: {counted(len(report['checkpoints']), 'checkpoint')} at common steps; "
             f"the runs are {verdict}")
    for side, key in (("a", "steps_only_in_a"), ("b", "steps_only_in_b")):
        if report[key]:
            out.line(f"steps saved only in {side}: {_ranges(report[key])}")
    divergence = report["first_divergence"]
    if divergence:
        amount = "" if divergence["max_abs"] is None else \
            f": max abs difference {divergence['max_abs']:.3g}, max relative {divergence['max_rel']:.3g}"
        out.line(f"first divergence: step {divergence['step']} ({divergence['checkpoint']}), tensor "
                 f"{divergence['tensor']}{amount}")
    columns = [Column("field", KEY), Column("kind"), Column("rank", right=True), Column("a", TEXT),
               Column("b", TEXT), Column("from step", right=True), Column("evidence", TEXT)]
    for explains, title in ((True, "that could explain it"), (False, "that cannot explain it")):
        found = [d for d in report["differences"] if d.get("explains", True) is explains]
        if found:
            out.table(f"{counted(len(found), 'recorded difference')} {title}", columns, (
                (d["field"], d["kind"], words(d.get("rank")), words(d["a"]), words(d["b"]), words(d["first_step"]),
                 words(d.get("evidence"))) for d in found))
    return _found(not report["identical"])


def _found(something) -> int:
    """An analysis command's exit code (docs/usage.md, Exit codes): 1 when it found something (a difference,
    a straggler), 0 when it found nothing; 2, when it cannot run, comes from the error."""
    return 1 if something else 0


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
        from ckptfmt import analytics
    except ImportError as exc:
        raise CheckpointError(f"ckptfmt analytics needs pyarrow ({exc}): pip install 'ckptfmt[analytics]'") from None
    return analytics


def _jsonable(value: Any, depth: int = 0) -> Any:
    """Make metadata printable as JSON (bytes summarised, tuples as lists, keys as strings, depth bounded)."""
    if isinstance(value, (dict, list, tuple, set, frozenset)) and depth == _JSON_DEPTH:
        return f"<nested deeper than {_JSON_DEPTH} levels>"
    if isinstance(value, dict):
        return {short(k, 200) if isinstance(k, str) else quoted(k): _jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v, depth + 1) for v in value]
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return quoted(value)
