"""Benchmark ckptfmt against torch.save, safetensors and torch DCP.

Usage (from the repository root)::

    python bench/run.py [--size-gb 1.3] [--repeats 3] [--dir /path] [--quick] [--json PATH]

One transformer-shaped fp32 state dict (24 blocks of hidden 1024 / FFN 4096
plus a 32000x1024 embedding = 385 tensors, 1.34 GB; ``--size-gb`` scales the
block count, ``--quick`` means 0.2 GB and 1 repeat) filled with seeded randn is
used for every section:

1. durable save: ``ckptfmt.save`` into a fresh repo per repeat vs torch.save +
   fsync, safetensors save_file + fsync, DCP save (2 writer threads, fsync).
   Before each repeat one element per 4 KiB page is rewritten (untimed), so
   every repeat is a true first save: ckptfmt keeps an in-process hash cache
   keyed by memory address that would otherwise skip hashing from repeat 2 on.
2. cold load: page cache of the checkpoint evicted (fsync + FADV_DONTNEED),
   then load and read one element per 4 KiB page of every tensor: ckptfmt.load
   vs safetensors load_file vs torch.load(mmap=True) vs DCP load into new
   tensors. The page sums double as a checksum against the original state.
3. lazy cold read of one 1024x4096 fp32 tensor (16 MiB): ckptfmt.open +
   get_tensor vs safetensors safe_open + get_tensor (at least 5 repeats).
4. cold ``ckptfmt.tools.verify``, reported as tensor bytes / second.
5. second save after changing ~10% of the tensors (every 10th key ordered by
   size, so ~10% of the bytes too; +1e-3 in place each repeat, so every repeat
   is new content): ckptfmt into the same repo under a new name, timed and
   measured in bytes added to the repo, vs full baseline saves.
6. peak RSS of one save, each in a fresh process (this script with
   ``--peak-child``): VmHWM after the save vs RSS after building the state.

Competitors run round-robin within each repeat (order rotated per repeat);
tables show median and min wall time and median ratios to each baseline. A
final table checks the performance targets. Errors (e.g. a ckptfmt function not
written yet) are reported in the row and the run carries on. Scratch data lives
in a temporary directory under ``--dir`` (default /tmp; must be a real disk,
not tmpfs) and is removed at the end.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors
import torch
from competitors import (
    LAZY_READERS,
    LOADER_SOURCE,
    LOADERS,
    SAVERS,
    ckptfmt_api,
    save_ckptfmt,
)
from harness import (
    GB,
    MiB,
    Result,
    Scratch,
    build_state,
    check_checksum,
    console,
    dir_bytes,
    evict,
    fmt_ratio,
    fs_type,
    lazy_key,
    median_int,
    nan_to_none,
    ratio,
    refresh_content,
    results_json,
    round_robin,
    run_in_scratch,
    state_nbytes,
    timed,
    times_table,
    touch,
)
from rich.markup import escape
from rich.table import Table

SAVE_BASELINES = ["torch.save", "safetensors", "DCP"]
LOAD_BASELINES = ["safetensors", "torch.load(mmap)", "DCP"]
PEAK_COMPETITORS = ["ckptfmt", "torch.save", "safetensors"]
LAZY_MIN_REPEATS = 5
CHANGED_EVERY = 10  # second save changes every 10th tensor
QUICK_SIZE_GB = 0.2
DEFAULT_SIZE_GB = 1.3


@dataclass
class Checkpoint:
    """A saved checkpoint: ``root`` holds only it (evicted/measured whole); ``path`` is opened."""

    root: Path
    path: str


# ------------------------------------------------------------------------ sections


def bench_save(state: dict, scratch: Scratch, repeats: int,
               savers: Mapping[str, Callable[..., str]] = SAVERS, fresh_every_call: bool = False
               ) -> tuple[dict[str, Result], dict[str, Checkpoint]]:
    """Section 1: durable saves, each into a fresh directory, of content never saved before.

    The content is refreshed (``refresh_content``, untimed) per repeat, so all
    savers of a repeat write the same bytes, or before every call when
    ``fresh_every_call`` (needed when several ckptfmt savers share a repeat).
    Returns the results and, per saver, the checkpoint of its last successful save.
    """
    saved: dict[str, Checkpoint] = {}
    calls = itertools.count()

    def competitor(name: str) -> Callable[[int], float]:
        def run(rep: int) -> float:
            refresh_content(state, next(calls) if fresh_every_call else rep)
            saved.pop(name, None)
            out = scratch.fresh(name)
            seconds, path = timed(lambda: savers[name](state, out, f"ckpt-{rep}"))
            saved[name] = Checkpoint(out, path)
            return seconds
        return run

    results = round_robin("save", {name: competitor(name) for name in savers}, repeats)
    return results, saved


def load_and_touch(loader: Callable[[str, Mapping], Any], ckpt: Checkpoint, like: Mapping
                   ) -> tuple[Any, float]:
    """Load ``ckpt`` and touch every page; return (state, checksum)."""
    loaded = loader(ckpt.path, like)
    return loaded, touch(loaded)


def require(saved: Mapping[str, Checkpoint], source: str) -> Checkpoint:
    """The checkpoint written by ``source``, or an error if its save failed."""
    if source not in saved:
        raise RuntimeError(f"no {source} checkpoint to read (its save failed)")
    return saved[source]


def bench_load(state: dict, saved: Mapping[str, Checkpoint], repeats: int,
               loaders: Mapping[str, Callable[[str, Mapping], Any]] = LOADERS,
               source: Mapping[str, str] = LOADER_SOURCE) -> dict[str, Result]:
    """Section 2: cold load + touch of every page of every tensor.

    ``source[name]`` is the key in ``saved`` of the checkpoint loader ``name`` reads.
    """
    expected = touch(state)

    def competitor(name: str) -> Callable[[int], float]:
        def run(rep: int) -> float:
            ckpt = require(saved, source[name])
            evict(ckpt.root)
            seconds, (loaded, checksum) = timed(lambda: load_and_touch(loaders[name], ckpt, state))
            del loaded  # freed outside the timed region
            check_checksum(checksum, expected)
            return seconds
        return run

    return round_robin("cold load", {name: competitor(name) for name in loaders}, repeats)


def bench_lazy(state: dict, saved: Mapping[str, Checkpoint], repeats: int,
               readers: Mapping[str, Callable[[str, str], float]] = LAZY_READERS
               ) -> dict[str, Result]:
    """Section 3: cold lazy read of one 16 MiB tensor from ``saved[name]`` per reader."""
    key = lazy_key(state)
    expected = touch(state[key])

    def competitor(name: str) -> Callable[[int], float]:
        def run(rep: int) -> float:
            ckpt = require(saved, name)
            evict(ckpt.root)
            seconds, checksum = timed(lambda: readers[name](ckpt.path, key))
            check_checksum(checksum, expected)
            return seconds
        return run

    competitors = {name: competitor(name) for name in readers}
    return round_robin("lazy read", competitors, max(repeats, LAZY_MIN_REPEATS))


def bench_verify(saved: Mapping[str, Checkpoint], repeats: int) -> tuple[dict[str, Result], list[int]]:
    """Section 4: cold ckptfmt.verify; also returns report.bytes_checked per run."""
    bytes_checked: list[int] = []

    def run(rep: int) -> float:
        ckpt = require(saved, "ckptfmt")
        evict(ckpt.root)
        seconds, report = timed(lambda: ckptfmt_api().verify(ckpt.path))
        if not report.ok:
            raise RuntimeError(f"verify reported a corrupt checkpoint: {report!r}")
        bytes_checked.append(int(report.bytes_checked))
        return seconds

    return round_robin("verify", {"ckptfmt": run}, repeats), bytes_checked


def changed_keys(state: Mapping[str, torch.Tensor]) -> list[str]:
    """Every 10th key ordered by (numel, key): ~10% of the tensors and of the bytes."""
    ordered = sorted(state, key=lambda k: (state[k].numel(), k))
    return ordered[::CHANGED_EVERY]


def bench_second_save(state: dict, saved: Mapping[str, Checkpoint], scratch: Scratch,
                      repeats: int) -> tuple[dict[str, Result], list[int], list[str]]:
    """Section 5: save again after changing ~10% of the tensors.

    ckptfmt saves into the repo of its last first-save under a new name; the
    baselines do full saves into fresh directories. Returns the results, the
    bytes each ckptfmt second save added to its repo, and the changed keys.
    """
    changed = changed_keys(state)
    added: list[int] = []

    def mutate(rep: int) -> None:
        with torch.no_grad():
            for key in changed:
                state[key].add_(1e-3)

    def ckptfmt_second(rep: int) -> float:
        root = require(saved, "ckptfmt").root
        before = dir_bytes(root)
        seconds, _ = timed(lambda: save_ckptfmt(state, root, f"ckpt-second-{rep}"))
        added.append(dir_bytes(root) - before)
        return seconds

    def baseline(name: str) -> Callable[[int], float]:
        def run(rep: int) -> float:
            out = scratch.fresh(f"second-{name}")
            seconds, _ = timed(lambda: SAVERS[name](state, out, f"ckpt-second-{rep}"))
            return seconds
        return run

    competitors = {"ckptfmt": ckptfmt_second, **{name: baseline(name) for name in SAVE_BASELINES}}
    results = round_robin("second save", competitors, repeats, before_repeat=mutate)
    return results, added, changed


def proc_status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (e.g. VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_child(name: str, size_gb: float, seed: int, out: Path) -> dict[str, int]:
    """In a fresh process: build the state, save it once, report RSS figures in bytes.

    The peak is VmHWM, not ru_maxrss: across exec Linux carries the parent's
    high-water mark into ru_maxrss, which would report the parent's RSS here.
    """
    state = build_state(size_gb, seed)
    rss_after_build = proc_status_bytes("VmRSS")
    SAVERS[name](state, out, "ckpt")
    return {"state_bytes": state_nbytes(state), "rss_after_build": rss_after_build,
            "peak_rss": proc_status_bytes("VmHWM")}


def bench_peak_memory(size_gb: float, seed: int, scratch: Scratch) -> dict[str, dict[str, Any]]:
    """Section 6: peak RSS of one save per competitor, each in its own process."""
    report: dict[str, dict[str, Any]] = {}
    for name in PEAK_COMPETITORS:
        out = scratch.fresh(f"peak-{name}")
        cmd = [sys.executable, __file__, "--peak-child", name, "--size-gb", str(size_gb),
               "--seed", str(seed), "--dir", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0:
            report[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        else:
            lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
            report[name] = {"error": lines[-1]}
        shutil.rmtree(out, ignore_errors=True)
    return report


# -------------------------------------------------------------------------- output


def second_save_table(results: Mapping[str, Result], first: Result, median_added: int | None,
                      first_bytes: int | None, changed: list[str], state: Mapping) -> Table:
    """ckptfmt's incremental save relative to its first save."""
    changed_bytes = sum(state[k].numel() * state[k].element_size() for k in changed)
    table = Table(title="5b. ckptfmt second save vs its first save", title_justify="left")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("tensors changed", f"{len(changed)} / {len(state)} "
                  f"({changed_bytes / state_nbytes(state):.1%} of bytes)")
    table.add_row("time / first save time", fmt_ratio(ratio(results["ckptfmt"].median, first.median)))
    table.add_row("bytes added (median)", "-" if median_added is None else f"{median_added / 1e6:.1f} MB")
    table.add_row("first checkpoint bytes", "-" if first_bytes is None else f"{first_bytes / 1e6:.1f} MB")
    table.add_row("bytes added / first checkpoint",
                  "-" if median_added is None or not first_bytes else f"{median_added / first_bytes:.1%}")
    return table


def peak_table(report: Mapping[str, Mapping[str, Any]]) -> Table:
    """RSS figures of the single-save processes, in MiB."""
    table = Table(title="6. peak RSS of one save (fresh process, MiB)", title_justify="left")
    for column in ("competitor", "state", "RSS after build", "peak RSS",
                   "peak - state", "peak - RSS after build"):
        table.add_column(column, justify="left" if column == "competitor" else "right")
    table.add_column("note", style="red")
    for name, row in report.items():
        if "error" in row:
            table.add_row(name, "-", "-", "-", "-", "-", row["error"])
            continue
        mib = {k: v / MiB for k, v in row.items()}
        table.add_row(name, f"{mib['state_bytes']:.0f}", f"{mib['rss_after_build']:.0f}",
                      f"{mib['peak_rss']:.0f}", f"{mib['peak_rss'] - mib['state_bytes']:.0f}",
                      f"{mib['peak_rss'] - mib['rss_after_build']:.0f}", "")
    return table


def evaluate_targets(sections: Mapping[str, Mapping[str, Result]], details: Mapping[str, Any]
                     ) -> list[dict[str, Any]]:
    """Check the performance targets; a missing measurement gives status n/a."""
    def median(section: str, name: str) -> float:
        result = sections[section].get(name)
        return result.median if result else math.nan

    verify = median("verify", "ckptfmt")
    added, first_bytes = details.get("second_save_added_median"), details.get("first_checkpoint_bytes")
    peak = details["peak_memory"].get("ckptfmt", {})
    checks = [
        ("durable save / safetensors save_file+fsync",
         ratio(median("save", "ckptfmt"), median("save", "safetensors")), "<=", 1.0, "x"),
        ("durable save / torch.save+fsync",
         ratio(median("save", "ckptfmt"), median("save", "torch.save")), "<=", 0.8, "x"),
        ("cold load / safetensors load_file",
         ratio(median("load", "ckptfmt"), median("load", "safetensors")), "<=", 1.0, "x"),
        ("lazy 16 MiB read / safe_open",
         ratio(median("lazy", "ckptfmt"), median("lazy", "safetensors")), "<=", 2.0, "x"),
        ("verify throughput", details["state_bytes"] / GB / verify, ">=", 1.5, " GB/s"),
        ("second save: bytes added / first checkpoint",
         ratio(added if added is not None else math.nan, first_bytes or math.nan), "<=", 0.12, "%"),
        ("second save: time / first save",
         ratio(median("second_save", "ckptfmt"), median("save", "ckptfmt")), "<=", 0.25, "%"),
        ("peak save RSS - RSS after building state",
         (peak["peak_rss"] - peak["rss_after_build"]) / MiB if "peak_rss" in peak else math.nan,
         "<=", 256.0, " MiB"),
    ]
    rows = []
    for name, value, op, limit, unit in checks:
        if math.isnan(value):
            status = "n/a"
        else:
            status = "PASS" if (value <= limit if op == "<=" else value >= limit) else "FAIL"
        rows.append({"target": name, "value": nan_to_none(value), "op": op, "limit": limit,
                     "unit": unit, "status": status})
    return rows


def fmt_value(value: float | None, unit: str) -> str:
    """A target value in its unit."""
    if value is None:
        return "-"
    if unit == "%":
        return f"{value:.1%}"
    return f"{value:.2f}{unit}" if unit in ("x", " GB/s") else f"{value:.0f}{unit}"


def targets_table(rows: list[dict[str, Any]]) -> Table:
    """PASS / FAIL / n/a per target."""
    table = Table(title="targets", title_justify="left")
    for column in ("target", "measured", "limit", "status"):
        table.add_column(column, justify="left" if column == "target" else "right")
    style = {"PASS": "green", "FAIL": "red", "n/a": "yellow"}
    for row in rows:
        table.add_row(row["target"], fmt_value(row["value"], row["unit"]),
                      f"{row['op']} {fmt_value(row['limit'], row['unit'])}",
                      f"[{style[row['status']]}]{row['status']}[/]")
    return table


# ---------------------------------------------------------------------------- main


def describe_setup(state: Mapping, repeats: int, workdir: Path) -> dict[str, Any]:
    """Print and return the run configuration."""
    try:
        ckptfmt_status = f"ckptfmt {getattr(ckptfmt_api(), '__version__', '(no __version__)')}"
    except RuntimeError as exc:
        ckptfmt_status = str(exc)
    config = {
        "state_bytes": state_nbytes(state), "tensors": len(state), "repeats": repeats,
        "workdir": str(workdir), "filesystem": fs_type(workdir), "torch": torch.__version__,
        "safetensors": safetensors.__version__, "ckptfmt": ckptfmt_status,
        "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
    }
    console.print(f"[bold]state[/] {config['state_bytes'] / GB:.2f} GB in {len(state)} fp32 tensors, "
                  f"{repeats} repeat(s), scratch {workdir} ({config['filesystem']})")
    console.print(f"torch {torch.__version__}, safetensors {safetensors.__version__}, "
                  f"{escape(ckptfmt_status)}, {config['cpus']} CPUs")
    if config["filesystem"] in ("tmpfs", "ramfs"):
        console.print("[yellow]warning: scratch is in memory; cold reads are not cold[/]")
    return config


def run_all(size_gb: float, repeats: int, seed: int, workdir: Path) -> dict[str, Any]:
    """Run every section, print its table, return the JSON report."""
    state = build_state(size_gb, seed)
    config = describe_setup(state, repeats, workdir)
    scratch = Scratch(workdir)
    nbytes = config["state_bytes"]
    sections: dict[str, dict[str, Result]] = {}
    details: dict[str, Any] = {"state_bytes": nbytes}

    sections["save"], saved = bench_save(state, scratch, repeats)
    console.print(times_table("1. durable save", sections["save"], SAVE_BASELINES, nbytes))
    if "ckptfmt" in saved:
        details["first_checkpoint_bytes"] = dir_bytes(saved["ckptfmt"].root)

    sections["load"] = bench_load(state, saved, repeats)
    console.print(times_table("2. cold load + touch every page", sections["load"], LOAD_BASELINES, nbytes))

    sections["lazy"] = bench_lazy(state, saved, repeats)
    console.print(times_table("3. lazy cold read of one 16 MiB tensor", sections["lazy"], ["safetensors"]))

    sections["verify"], details["verify_bytes_checked"] = bench_verify(saved, repeats)
    console.print(times_table("4. ckptfmt.verify (cold)", sections["verify"], [], nbytes))

    sections["second_save"], added, changed = bench_second_save(state, saved, scratch, repeats)
    details["second_save_added_bytes"] = added
    details["second_save_added_median"] = median_int(added)
    details["changed_tensors"] = len(changed)
    console.print(times_table("5. second save, ~10% of tensors changed (ckptfmt: same repo; "
                              "baselines: full save)", sections["second_save"], SAVE_BASELINES))
    console.print(second_save_table(sections["second_save"], sections["save"]["ckptfmt"],
                                    details["second_save_added_median"],
                                    details.get("first_checkpoint_bytes"), changed, state))

    del state, saved
    details["peak_memory"] = bench_peak_memory(size_gb, seed, scratch)
    console.print(peak_table(details["peak_memory"]))

    targets = evaluate_targets(sections, details)
    console.print(targets_table(targets))
    return {"config": config, "sections": {k: results_json(v) for k, v in sections.items()},
            "details": details, "targets": targets}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, help=f"state size (default {DEFAULT_SIZE_GB})")
    parser.add_argument("--repeats", type=int, help="repeats per measurement (default 3)")
    parser.add_argument("--dir", help="parent of the scratch directory (default /tmp)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: {QUICK_SIZE_GB} GB, 1 repeat (unless given explicitly)")
    parser.add_argument("--json", help="also write the results as JSON to this path")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random state")
    parser.add_argument("--peak-child", choices=PEAK_COMPETITORS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.size_gb is None:
        args.size_gb = QUICK_SIZE_GB if args.quick else DEFAULT_SIZE_GB
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    if args.peak_child:
        print(json.dumps(peak_child(args.peak_child, args.size_gb, args.seed, Path(args.dir))))
        return 0
    return run_in_scratch(
        args.dir, "ckptfmt-bench-", lambda workdir: run_all(args.size_gb, args.repeats, args.seed, workdir),
        args.json, console,
    )


if __name__ == "__main__":
    sys.exit(main())
