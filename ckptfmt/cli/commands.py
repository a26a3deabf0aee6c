"""One function per CLI command: (parsed args, console) -> exit code."""

from __future__ import annotations

import json
from typing import Any

from fsspec.callbacks import Callback
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from .. import diff as diff_module
from ..errors import CheckpointError
from ..reader import open as open_checkpoint
from ..repository import Repository
from ..verify import verify as verify_url
from .render import human_bytes, human_time, new_table, number, shape_text


def ls(args, console: Console) -> int:
    repo = Repository.open(args.repo)
    records = repo.commits()
    if args.json:
        console.print_json(data=[{
            "name": r.name, "step": r.step, "created_ns": r.created_ns, "parent": r.parent,
            "manifest": r.manifest_hash, **r.stats,
        } for r in records])
        return 0
    table = new_table(f"{repo.url}: {len(records)} checkpoints")
    for column in ("name", "step", "created", "size", "new bytes", "parent"):
        numeric = column in ("step", "size", "new bytes")
        table.add_column(column, justify="right" if numeric else "left", no_wrap=True, overflow="ellipsis")
    for r in records:
        table.add_row(
            r.name, str(r.step) if r.step is not None else "-", human_time(r.created_ns),
            human_bytes(r.stats.get("stored_bytes")),
            human_bytes(r.stats.get("new_bytes")), r.parent or "-",
        )
    console.print(table)
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
        _show_summary(console, ckpt.url, ckpt.id, meta)
        _show_tensors(console, tensors, args.limit)
        _show_metadata(console, meta)
    return 0


def _show_summary(console: Console, url: str, ident: str, meta: dict) -> None:
    stats = meta["stats"]
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("checkpoint", url), ("id", ident), ("step", str(meta["step"])), ("created", human_time(meta["created_ns"])),
        ("parent", meta["parent"] or "-"), ("format", ".".join(map(str, meta["format_version"]))),
        ("tensors", f"{stats.get('tensor_count')} ({human_bytes(stats.get('tensor_bytes'))})"),
        ("stored", f"{human_bytes(stats.get('stored_bytes'))} in {stats.get('chunk_count')} chunks, "
                   f"{human_bytes(stats.get('new_bytes'))} new"),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _show_tensors(console: Console, tensors: list, limit: int) -> None:
    shown = tensors if limit <= 0 else tensors[:limit]
    table = new_table(f"tensors ({len(shown)} of {len(tensors)})")
    for column in ("key", "dtype", "shape", "size", "shards"):
        numeric = column in ("size", "shards")
        table.add_column(column, justify="right" if numeric else "left", no_wrap=numeric, overflow="fold")
    for t in shown:
        table.add_row(t.key, t.dtype, shape_text(t.shape), human_bytes(t.nbytes), str(len(t.shards)))
    console.print(table)


def _show_metadata(console: Console, meta: dict) -> None:
    env = meta["environment"]
    torch_info = env.get("torch", {})
    git = env.get("git") or {}
    table = new_table("metadata", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("host", f"{env.get('hostname')} ({env.get('os', {}).get('platform')})")
    table.add_row("cpu / gpus", f"{env.get('cpu', {}).get('model')} / {[g['name'] for g in env.get('gpus', [])] or 'none'}")
    table.add_row("python / torch", f"{env.get('python', {}).get('version')} / {torch_info.get('version')} "
                                    f"(cuda {torch_info.get('cuda')}, cudnn {torch_info.get('cudnn')}, nccl {torch_info.get('nccl')})")
    table.add_row("git", f"{git.get('commit', '-')}{' (dirty)' if git.get('dirty') else ''}" if git else "-")
    determinism = env.get("determinism", {})
    table.add_row("determinism", ", ".join(f"{k}={v}" for k, v in determinism.items() if k != "env"))
    table.add_row("determinism env", ", ".join(f"{k}={v}" for k, v in determinism.get("env", {}).items()))
    for entry in meta["rng"]:
        generators = ["torch_cpu"] + (["cuda"] * bool(entry.get("cuda"))) + [g for g in ("numpy", "python") if entry.get(g)]
        table.add_row(f"rng rank {entry.get('rank')}", f"{', '.join(generators)}; torch seed {entry.get('torch_initial_seed')}")
    topo = meta["topology"]
    hosts = ", ".join(f"{r.get('rank')}@{r.get('host')}" for r in topo.get("ranks", []))
    table.add_row("topology", f"world size {topo.get('world_size')}, parallelism {topo.get('parallelism')}, ranks {hosts}")
    for rank in meta["timing"].get("ranks", []):
        phases = ", ".join(f"{p['name']} {p['duration_s'] * 1000:.0f} ms" for p in rank.get("phases", []))
        table.add_row(f"save timing rank {rank.get('rank')}", f"{rank.get('total_s', 0) * 1000:.0f} ms: {phases}")
    if meta["timing"].get("steps"):
        table.add_row("step times", f"{len(meta['timing']['steps'])} recorded")
    table.add_row("user", json.dumps(_jsonable(meta["user"]))[:500])
    console.print(table)


class _RichCallback(Callback):
    """Feeds fsspec progress (bytes) into a rich progress bar."""

    def __init__(self, progress: Progress):
        super().__init__()
        self.progress = progress
        self.task = progress.add_task("verifying", total=None)

    def call(self, *args, **kwargs):
        self.progress.update(self.task, total=self.size, completed=self.value)


def verify(args, console: Console) -> int:
    progress = Progress(
        TextColumn("[progress.description]{task.description}"), BarColumn(), DownloadColumn(),
        TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True), transient=True,
        disable=args.json,
    )
    with progress:
        report = verify_url(args.url, callback=_RichCallback(progress))
    if args.json:
        console.print_json(data={
            "ok": report.ok, "checkpoints": report.checkpoints, "chunks_checked": report.chunks_checked,
            "bytes_checked": report.bytes_checked, "seconds": report.seconds,
            "problems": [p.__dict__ | {"tensors": list(p.tensors)} for p in report.problems],
        })
        return 0 if report.ok else 1
    rate = report.bytes_checked / report.seconds / 1e9 if report.seconds else 0.0
    summary = (f"{len(report.checkpoints)} checkpoint(s), {report.chunks_checked} chunks, "
               f"{human_bytes(report.bytes_checked)} in {report.seconds:.2f} s ({rate:.2f} GB/s)")
    if report.ok:
        console.print(f"[green]OK[/green]: {summary}")
        return 0
    table = new_table(f"[red]DAMAGED[/red]: {len(report.problems)} problem(s) in {summary}")
    for column in ("checkpoint", "problem", "chunk", "tensors", "detail"):
        table.add_column(column, overflow="fold")
    for p in report.problems:
        table.add_row(p.checkpoint, p.kind, (p.chunk or "-")[:16], "\n".join(p.tensors) or "-", p.message)
    console.print(table)
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
    console.print(f"[bold]{report.a}[/bold] -> [bold]{report.b}[/bold]: "
                  + ", ".join(f"{n} {s}" for s, n in counts.items()))
    moved = [t for t in report.tensors if t.status != "unchanged"]
    shown = moved if args.limit <= 0 else moved[: args.limit]
    if moved:
        table = new_table(f"tensors that differ, most moved first ({len(shown)} of {len(moved)})")
        for column in ("key", "status", "dtype", "shape", "max |diff|", "rel L2", "changed"):
            numeric = column in ("max |diff|", "rel L2", "changed")
            table.add_column(column, justify="right" if numeric else "left", no_wrap=numeric, overflow="fold")
        for t in shown:
            dtype = t.dtype[0] if t.dtype[0] == t.dtype[1] else f"{t.dtype[0]} -> {t.dtype[1]}"
            shape = shape_text(t.shape[0]) if t.shape[0] == t.shape[1] else f"{shape_text(t.shape[0])} -> {shape_text(t.shape[1])}"
            changed = f"{t.frac_changed:.1%}" if t.frac_changed is not None else "-"
            table.add_row(t.key, t.status, dtype, shape, number(t.max_abs_diff), number(t.rel_l2), changed)
        console.print(table)
    interesting = [m for m in report.metadata if not m[0].startswith(("rng.", "environment.packages"))]
    if report.metadata:
        table = new_table(f"metadata that differs ({len(report.metadata)} fields; RNG states and packages summarised)")
        for column in ("field", "A", "B"):
            table.add_column(column, overflow="fold")
        for field, va, vb in interesting:
            table.add_row(field, str(va), str(vb))
        rng_changed = sorted({m[0].split(".")[1] for m in report.metadata if m[0].startswith("rng.")})
        packages = [m for m in report.metadata if m[0].startswith("environment.packages")]
        if rng_changed:
            table.add_row("rng", f"states differ for rank(s) {', '.join(rng_changed)}", "")
        if packages:
            table.add_row("packages", f"{len(packages)} package version(s) differ", "")
        console.print(table)
    return 0


def export(args, console: Console) -> int:
    from ..converters.export import export_checkpoint  # converters stay out of the core's imports

    result = export_checkpoint(args.checkpoint, args.dest, format=args.format,
                               max_shard_size=args.max_shard_size, prefix=args.prefix, world_size=args.world_size,
                               zero_stage=args.zero_stage, ds_config=_json_file(args.ds_config))
    console.print(f"wrote {result.path} ({result.tensors} tensors, {human_bytes(result.bytes)})")
    for note in result.notes:
        console.print(f"note: {note}")
    return 0


def _json_file(path: str | None) -> dict | None:
    """A JSON object from a file (e.g. a DeepSpeed config), or a CheckpointError naming the file."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def _tp_dims(values: list[str] | None) -> dict | None:
    """``--tp-dim REGEX=DIM`` options as the DeepSpeed reader's tp_dims (DIM a dimension, or replicated)."""
    dims = {}
    for value in values or []:
        pattern, _, dim = value.rpartition("=")
        if not pattern or not (dim == "replicated" or dim.isdigit()):
            raise CheckpointError(f"--tp-dim {value!r}: expected REGEX=DIM, DIM a dimension or 'replicated'")
        dims[pattern] = None if dim == "replicated" else int(dim)
    return dims or None


def import_(args, console: Console) -> int:
    from ..converters.importer import import_checkpoint  # converters stay out of the core's imports

    tp_dims = _tp_dims(args.tp_dim)
    result = import_checkpoint(args.src, args.dest, kind=args.kind, step=args.step,
                               options={"tp_dims": tp_dims} if tp_dims else None)
    console.print(f"imported {args.src} ({result.kind}) as {result.url}: {result.tensors} tensors, "
                  f"{len(result.opaque)} opaque objects, {result.seconds:.2f} s", markup=False, highlight=False)
    for key in result.opaque:
        console.print(f"opaque: {key}", markup=False, highlight=False)
    for note in result.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    return 0


def tui(args, console: Console) -> int:
    from ..tui import main  # the TUI (textual) stays out of the core's imports

    return main(args.targets)


def _jsonable(value: Any) -> Any:
    """Make metadata printable as JSON (bytes summarised, tuples as lists, keys as strings)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)
