"""One function per CLI command: (parsed args, console) -> exit code."""

from __future__ import annotations

import dataclasses
import json
import warnings
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .. import describe
from .. import diff as diff_module
from ..describe import text
from ..errors import CheckpointError, CheckpointWarning, quoted
from ..formatting import counted, human_bytes, human_time, number, seconds, shape_text, short
from ..reader import open as open_checkpoint
from ..repository import Repository
from ..verify import verify as verify_url
from .render import ByteProgress, add_name_column, add_row, new_table, print_table


def ls(args, console: Console) -> int:
    repo = Repository.open(args.repo)
    records = repo.commits()
    if args.json:  # written as is: rich's print_json takes seconds for 10,000 checkpoints
        console.file.write(json.dumps([{
            **r.stats, "name": r.name, "step": r.step, "created_ns": r.created_ns, "parent": r.parent,
            "manifest": r.manifest_hash,
        } for r in records], indent=1) + "\n")
        return 0
    table = new_table(f"{repo.url}: {counted(len(records), 'checkpoint')}")
    add_name_column(table, "name", (r.name for r in records))
    for column in ("step", "created", "size", "new bytes"):
        table.add_column(column, justify="left" if column == "created" else "right", no_wrap=True)
    add_name_column(table, "parent", (r.parent or "-" for r in records))
    for r in records:
        add_row(table, r.name, text(r.step), human_time(r.created_ns), human_bytes(r.stats.get("stored_bytes")),
                human_bytes(r.stats.get("new_bytes")), r.parent or "-")
    print_table(console, table)
    return 0


def show(args, console: Console) -> int:
    with open_checkpoint(args.checkpoint) as ckpt:
        meta = ckpt.metadata
        tensors = [ckpt.tensor_info(k) for k in ckpt.keys()]
        if args.json:
            console.print_json(data=_jsonable({
                "url": ckpt.url, "id": ckpt.id, **meta,
                "tensors": [{"key": t.key, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes,
                             "shards": len(t.shards), "kind": t.kind} for t in tensors],
            }))
            return 0
        _show_summary(console, describe.summary(meta, ckpt.url, ckpt.id))
        _show_tensors(console, tensors, args.limit)
        _show_metadata(console, meta)
    return 0


def _show_summary(console: Console, rows: list[tuple[str, str]]) -> None:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(no_wrap=True)
    for row in rows:
        add_row(table, *row)
    print_table(console, table)


def _show_tensors(console: Console, tensors: list, limit: int) -> None:
    shown = tensors if limit <= 0 else tensors[:limit]
    table = new_table(f"tensors ({len(shown)} of {len(tensors)})")
    add_name_column(table, "key", (t.key for t in shown))
    table.add_column("dtype", no_wrap=True)
    table.add_column("shape")
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("shards", justify="right", no_wrap=True)
    for t in shown:
        add_row(table, t.key, t.dtype, shape_text(t.shape), human_bytes(t.nbytes), str(len(t.shards)))
    print_table(console, table)


def _show_metadata(console: Console, meta: dict) -> None:
    """Environment, RNG, topology, timing and user metadata, whatever their types (spec section 9)."""
    table = new_table("metadata", show_header=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for label, value in describe.environment(meta):
        add_row(table, label, value)
    for row in describe.rng(meta):
        add_row(table, f"rng rank {row.rank}", f"{row.generators}; torch seed {row.torch_seed}")
    topology = dict(describe.topology(meta))
    hosts = ", ".join(f"{r.rank}@{r.host}" for r in describe.ranks(meta)) or "-"
    add_row(table, "topology", f"world size {topology['world size']}, parallelism {topology['parallelism']}, "
                               f"ranks {hosts}")
    for timing in describe.save_timing(meta):
        phases = ", ".join(f"{name} {seconds(duration)}" for name, duration in timing.phases)
        add_row(table, f"save timing rank {timing.rank}", f"{seconds(timing.total_s)}: {phases or '-'}")
    steps = describe.step_summary(meta)
    if steps:
        add_row(table, "step times", steps)
    add_row(table, "user", short(json.dumps(_jsonable(meta.get("user"))), 500))
    console.print(table)


def verify(args, console: Console) -> int:
    with ByteProgress("verifying", quiet=args.json) as progress:
        report = verify_url(args.url, callback=progress)
    if args.json:
        console.print_json(data={
            "ok": report.ok, "checkpoints": report.checkpoints, "chunks_checked": report.chunks_checked,
            "bytes_checked": report.bytes_checked, "seconds": report.seconds,
            "problems": [p.__dict__ | {"tensors": list(p.tensors)} for p in report.problems],
            "warnings": report.warnings,
        })
        return 0 if report.ok else 1
    for message in report.warnings:
        warnings.warn(message, CheckpointWarning, stacklevel=1)
    rate = report.bytes_checked / report.seconds / 1e9 if report.seconds else 0.0
    summary = (f"{len(report.checkpoints)} checkpoint(s), {report.chunks_checked} chunks, "
               f"{human_bytes(report.bytes_checked)} in {report.seconds:.2f} s ({rate:.2f} GB/s)")
    if report.ok:
        console.print(Text.assemble(("OK", "green"), f": {summary}"))
        return 0
    table = new_table(f"DAMAGED: {len(report.problems)} problem(s) in {summary}")
    add_name_column(table, "checkpoint", (p.checkpoint for p in report.problems))
    table.add_column("problem", no_wrap=True)
    table.add_column("chunk", no_wrap=True)
    add_name_column(table, "tensors", (t for p in report.problems for t in p.tensors))
    table.add_column("detail", overflow="fold")
    for p in report.problems:
        add_row(table, p.checkpoint, p.kind, (p.chunk or "-")[:16], "\n".join(p.tensors) or "-", p.message)
    print_table(console, table)
    return 1


def diff(args, console: Console) -> int:
    report = diff_module.diff(args.a, args.b, measure=args.measure)
    if args.json:
        console.print_json(data=_jsonable({
            "a": report.a, "b": report.b,
            "tensors": [t.__dict__ for t in report.tensors],
            "metadata": [{"field": f, "a": va, "b": vb} for f, va, vb in report.metadata],
        }))
        return 0
    counts = {s: len(report.by_status(s)) for s in ("changed", "added", "removed", "unchanged")}
    console.print(Text.assemble((report.a, "bold"), " -> ", (report.b, "bold"), ": ",
                                ", ".join(f"{n} {s}" for s, n in counts.items())))
    moved = [t for t in report.tensors if t.status != "unchanged"]
    shown = moved if args.limit <= 0 else moved[: args.limit]
    if moved:
        table = new_table(f"tensors that differ, most moved first ({len(shown)} of {len(moved)})")
        add_name_column(table, "key", (t.key for t in shown))
        for column in ("status", "dtype", "shape", "max |diff|", "rel L2", "changed"):
            numeric = column in ("max |diff|", "rel L2", "changed")
            table.add_column(column, justify="right" if numeric else "left", no_wrap=column != "shape")
        for t in shown:
            dtype = t.dtype[0] if t.dtype[0] == t.dtype[1] else f"{t.dtype[0]} -> {t.dtype[1]}"
            shape = shape_text(t.shape[0]) if t.shape[0] == t.shape[1] else f"{shape_text(t.shape[0])} -> {shape_text(t.shape[1])}"
            changed = f"{t.frac_changed:.1%}" if t.frac_changed is not None else "-"
            add_row(table, t.key, t.status, dtype, shape, number(t.max_abs_diff), number(t.rel_l2), changed)
        print_table(console, table)
    interesting = [m for m in report.metadata if not m[0].startswith(("rng.", "environment.packages"))]
    if report.metadata:
        table = new_table(f"metadata that differs ({len(report.metadata)} fields; RNG states and packages summarised)")
        add_name_column(table, "field", (m[0] for m in interesting))
        table.add_column("A", overflow="fold")
        table.add_column("B", overflow="fold")
        for field, va, vb in interesting:
            add_row(table, field, short(va), short(vb))
        rng_changed = sorted({m[0].split(".")[1] for m in report.metadata if m[0].startswith("rng.")})
        packages = [m for m in report.metadata if m[0].startswith("environment.packages")]
        if rng_changed:
            add_row(table, "rng", f"states differ for rank(s) {', '.join(rng_changed)}", "")
        if packages:
            add_row(table, "packages", f"{len(packages)} package version(s) differ", "")
        print_table(console, table)
    return 0


#: Levels of metadata shown as JSON; deeper values (a user value tree may nest 256 deep) are elided.
_JSON_DEPTH = 32


def analytics_export(args, console: Console) -> int:
    analytics = _analytics()
    built = analytics.tables(args.repo)
    paths = analytics.export(built, args.out, args.format)
    table = new_table(f"{args.repo}: {counted(built['checkpoints'].num_rows, 'checkpoint')}")
    for column in ("table", "rows", "columns", "file"):
        table.add_column(column, justify="right" if column in ("rows", "columns") else "left")
    for (name, data), path in zip(built.items(), paths):
        table.add_row(name, number(data.num_rows), number(data.num_columns), str(path))
    print_table(console, table)
    return 0


def stragglers(args, console: Console) -> int:
    analytics = _analytics()
    report = analytics.stragglers(args.repo, thresholds=_thresholds(args))
    if args.json:
        console.print_json(data=report)
        return 0
    console.print(f"{args.repo}: {report['steps']} steps of {report['ranks']} ranks")
    table = new_table(f"{len(report['stragglers'])} stragglers (delays in a rank's own phases, beyond the jitter)")
    for column in ("rank", "host", "kind", "steps", "phase", "delay", "worst", "x median"):
        table.add_column(column, justify="right" if column in ("rank", "delay", "worst", "x median") else "left")
    for s in report["stragglers"]:
        table.add_row(str(s["rank"]), text(s["host"]), s["kind"], analytics.episode_ranges(s["episodes"]), s["phase"],
                      seconds(s["delay_s"]), seconds(s["max_delay_s"]), _times(s["ratio"]))
    print_table(console, table)
    if report["hosts"]:
        hosts = new_table("hosts with several slow ranks at once")
        for column in ("host", "slow ranks", "steps", "delay"):
            hosts.add_column(column)
        for h in report["hosts"]:
            hosts.add_row(text(h["host"]), f"{', '.join(map(str, h['ranks']))} of {h['of_ranks']}",
                          _ranges(h["steps"]), seconds(h["delay_s"]))
        print_table(console, hosts)
    if report["slow_saves"]:
        saves = new_table("slow saves (a rank's own save phases lagging the others')")
        for column in ("rank", "host", "checkpoints", "phases", "delay", "x median"):
            saves.add_column(column)
        for e in report["slow_saves"]:
            saves.add_row(str(e["rank"]), text(e["host"]), ", ".join(e["checkpoints"]),
                          ", ".join(sorted(set(e["phases"]))), seconds(e["delay_s"]), _times(e["ratio"]))
        print_table(console, saves)
    return 0


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
        from ..analytics.report import report as write_report
    except ImportError as exc:
        raise CheckpointError(f"ckptfmt report needs matplotlib ({exc}): pip install 'ckptfmt[analytics]'") from None
    made = write_report(args.repo, html_path=args.html, png_dir=args.png, compare_with=args.compare,
                        thresholds=_thresholds(args))
    for where in (args.html, args.png):
        if where is not None:
            console.print(f"wrote {where} ({len(made['figures'])} figures: {', '.join(made['figures'])})",
                          markup=False, highlight=False)
    return 0


def compare(args, console: Console) -> int:
    report = _analytics().compare(args.a, args.b, atol=args.atol, rtol=args.rtol)
    if args.json:
        console.print_json(data=report)
        return 0
    tolerance = f" within atol {args.atol:g}, rtol {args.rtol:g}" if args.atol or args.rtol else " bit for bit"
    steps = len(report["checkpoints"])
    verdict = "identical" + tolerance if report["identical"] else "different"
    console.print(f"{args.a} vs {args.b}: {steps} checkpoints at common steps; the runs are {verdict}")
    for side, key in (("a", "steps_only_in_a"), ("b", "steps_only_in_b")):
        if report[key]:
            console.print(f"steps saved only in {side}: {_ranges(report[key])}")
    divergence = report["first_divergence"]
    if divergence:
        amount = "" if divergence["max_abs"] is None else \
            f": max abs difference {divergence['max_abs']:.3g}, max relative {divergence['max_rel']:.3g}"
        console.print(f"first divergence: step {divergence['step']} ({divergence['checkpoint']}), tensor "
                      f"{divergence['tensor']}{amount}", markup=False, highlight=False)
    if report["differences"]:
        table = new_table(f"{len(report['differences'])} recorded differences that could explain it")
        for column in ("kind", "field", "rank", "a", "b", "from step"):
            table.add_column(column)
        for d in report["differences"]:
            table.add_row(d["kind"], d["field"], text(d.get("rank")), short(text(d["a"]), 40),
                          short(text(d["b"]), 40), text(d["first_step"]))
        print_table(console, table)
    return 0


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
        from .. import analytics
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
