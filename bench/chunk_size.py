"""Time ckptfmt at several chunk sizes, to choose the default ``chunk_size``.

Usage (from the repository root)::

    python bench/chunk_size.py [--size-gb 0.6] [--repeats 3] [--chunks-mib 4,16,64,256]
                               [--dir /path] [--json PATH]

Uses the same transformer-shaped fp32 state as ``bench/run.py`` (default
0.6 GB). For every chunk size N it times, round-robin over the sizes, median of
``--repeats``:

* ``ckptfmt.save(state, url, chunk_size=N)`` into a fresh repo (durable), of
  content refreshed before every save so no save reuses another's hashes,
* cold ``ckptfmt.load`` + reading one element per 4 KiB page of every tensor,
* cold ``ckptfmt.open(url).get_tensor`` of one 1024x4096 fp32 tensor (16 MiB),

and reports the repo's size and file count. Scratch data lives in a temporary
directory under ``--dir`` (default /tmp, a real disk) and is removed at the end.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from competitors import lazy_ckptfmt, load_ckptfmt, save_ckptfmt
from harness import (
    GB,
    MiB,
    Result,
    Scratch,
    build_state,
    console,
    files_under,
    fmt_time,
    results_json,
    run_in_scratch,
    state_nbytes,
)
from rich.table import Table
from rich.text import Text
from run import Checkpoint, bench_lazy, bench_load, bench_save

DEFAULT_CHUNKS_MIB = "4,16,64,256"


def label(chunk_mib: int) -> str:
    """Row name of a chunk size."""
    return f"{chunk_mib} MiB"


def repo_stats(saved: Mapping[str, Checkpoint]) -> dict[str, dict[str, int]]:
    """Bytes and file count of each saved repo."""
    stats = {}
    for name, ckpt in saved.items():
        files = files_under(ckpt.root)
        stats[name] = {"bytes": sum(f.stat().st_size for f in files), "files": len(files)}
    return stats


def chunk_table(sections: Mapping[str, Mapping[str, Result]], stats: Mapping[str, Mapping[str, int]],
                nbytes: int) -> Table:
    """One row per chunk size: save / cold load / lazy read times and repo layout."""
    table = Table(title="ckptfmt chunk size", title_justify="left")
    table.add_column("chunk size")
    for column in ("save", "save GB/s", "cold load", "load GB/s", "lazy 16 MiB", "repo MB", "files"):
        table.add_column(column, justify="right")
    table.add_column("note", overflow="fold", max_width=60)
    for name, save in sections["save"].items():
        load, lazy = sections["load"][name], sections["lazy"][name]
        errors = "; ".join(r.error for r in (save, load, lazy) if r.error)
        repo = stats.get(name, {})
        table.add_row(
            name,
            f"{fmt_time(save.median)} (min {fmt_time(save.min)})",
            f"{nbytes / GB / save.median:.2f}" if save.times else "-",
            f"{fmt_time(load.median)} (min {fmt_time(load.min)})",
            f"{nbytes / GB / load.median:.2f}" if load.times else "-",
            f"{fmt_time(lazy.median)} (min {fmt_time(lazy.min)})",
            f"{repo['bytes'] / 1e6:.1f}" if repo else "-",
            str(repo["files"]) if repo else "-",
            Text(errors, style="red"),
        )
    return table


def run_all(size_gb: float, repeats: int, chunks_mib: list[int], seed: int, workdir: Path
            ) -> dict[str, Any]:
    """Run the three measurements for every chunk size; print and return the results."""
    state = build_state(size_gb, seed)
    nbytes = state_nbytes(state)
    console.print(f"[bold]state[/] {nbytes / GB:.2f} GB in {len(state)} fp32 tensors, "
                  f"{repeats} repeat(s), chunk sizes {chunks_mib} MiB, scratch {workdir}")
    names = [label(c) for c in chunks_mib]
    savers = {label(c): functools.partial(save_ckptfmt, chunk_size=c * MiB) for c in chunks_mib}
    sections: dict[str, dict[str, Result]] = {}
    sections["save"], saved = bench_save(state, Scratch(workdir), repeats, savers, fresh_every_call=True)
    stats = repo_stats(saved)
    sections["load"] = bench_load(state, saved, repeats, dict.fromkeys(names, load_ckptfmt),
                                  {name: name for name in names})
    sections["lazy"] = bench_lazy(state, saved, repeats, dict.fromkeys(names, lazy_ckptfmt))
    console.print(chunk_table(sections, stats, nbytes))
    return {"config": {"state_bytes": nbytes, "tensors": len(state), "repeats": repeats,
                       "chunks_mib": chunks_mib},
            "sections": {k: results_json(v) for k, v in sections.items()}, "repos": stats}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=0.6, help="state size (default 0.6)")
    parser.add_argument("--repeats", type=int, default=3, help="repeats per measurement (default 3)")
    parser.add_argument("--chunks-mib", default=DEFAULT_CHUNKS_MIB,
                        help=f"comma-separated chunk sizes in MiB (default {DEFAULT_CHUNKS_MIB})")
    parser.add_argument("--dir", help="parent of the scratch directory (default /tmp)")
    parser.add_argument("--json", help="also write the results as JSON to this path")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random state")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    chunks_mib = [int(c) for c in args.chunks_mib.split(",")]
    return run_in_scratch(
        args.dir, "ckptfmt-chunks-",
        lambda workdir: run_all(args.size_gb, args.repeats, chunks_mib, args.seed, workdir), args.json, console,
    )


if __name__ == "__main__":
    sys.exit(main())
