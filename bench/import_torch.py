"""Time importing a torch.save file against the path it replaces, and its peak memory.

Usage (from the repository root)::

    python bench/import_torch.py [--size-gb 1.3] [--repeats 3] [--dir /path] [--json PATH]
                                 [--source FILE]

Writes the transformer-shaped fp32 state of ``bench/run.py`` with ``torch.save``
once (``--source``: into FILE, kept and reused by later runs), then times,
round-robin, median of ``--repeats``, each from a cold page cache into a fresh
repository:

* ``ckptfmt import``: ``ckptfmt.converters.import_checkpoint`` (restricted
  unpickler, storages memory-mapped, no pickled code run), and
* the baseline it must stay within 1.2x of: ``torch.load(mmap=True)`` followed
  by ``ckptfmt.save`` of the result.

The disk is noisy, so the ratio is also taken per repeat (each repeat runs both,
back to back): its median and spread are reported. Then the peak RSS of one
import in a fresh process, against the target of the source file's size plus
256 MB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from harness import (
    GB,
    MiB,
    Scratch,
    build_state,
    console,
    evict,
    fmt_ratio,
    ratio,
    round_robin,
    run_in_scratch,
    timed,
)

import ckptfmt
from ckptfmt.converters import import_checkpoint

TARGET_RATIO = 1.2
MEMORY_HEADROOM = 256 * MiB


def peak_child(source: str, dest: str) -> dict[str, int]:
    """In a fresh process: import ``source`` once; report RSS before and at peak (VmHWM)."""
    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    before = status("VmRSS")
    import_checkpoint(source, dest)
    return {"rss_before": before, "peak_rss": status("VmHWM")}


def write_source(size_gb: float, source: Path) -> None:
    """torch.save the benchmark state to ``source`` unless a file is there already."""
    if not source.exists():
        torch.save(build_state(size_gb), source)


def run_all(size_gb: float, repeats: int, workdir: Path, source: Path | None) -> dict:
    source = source or workdir / "state.pt"
    write_source(size_gb, source)
    scratch = Scratch(workdir)

    def competitor(name: str, run):
        def timed_run(rep: int) -> float:
            out = scratch.fresh(name)
            evict(source)
            seconds, _ = timed(lambda: run(str(source), f"{out}/imported"))
            return seconds
        return timed_run

    def baseline(src: str, dest: str) -> None:
        ckptfmt.save(torch.load(src, mmap=True, weights_only=True), dest)

    results = round_robin("import", {
        "ckptfmt import": competitor("import", lambda src, dest: import_checkpoint(src, dest)),
        "torch.load(mmap) + ckptfmt.save": competitor("baseline", baseline),
    }, repeats)
    child = subprocess.run(
        [sys.executable, __file__, "--peak-child", str(source), str(scratch.fresh("peak") / "imported")],
        capture_output=True, text=True, check=True,
    )
    peak = json.loads(child.stdout.strip().splitlines()[-1])
    times = {name: r.times for name, r in results.items()}
    return {
        "source_bytes": source.stat().st_size,
        "times_s": times,
        "median_s": {name: r.median for name, r in results.items()},
        "repeat_ratios": [ratio(a, b) for a, b in zip(times["ckptfmt import"],
                                                      times["torch.load(mmap) + ckptfmt.save"])],
        "peak": peak,
    }


def report(result: dict) -> None:
    medians = result["median_s"]
    mine, base = medians["ckptfmt import"], medians["torch.load(mmap) + ckptfmt.save"]
    size = result["source_bytes"]
    peak_over = result["peak"]["peak_rss"] - result["peak"]["rss_before"]
    console.print(f"torch.save file: {size / GB:.2f} GB")
    console.print(f"ckptfmt import: {mine:.2f} s; torch.load(mmap) + ckptfmt.save: {base:.2f} s; "
                  f"ratio {fmt_ratio(ratio(mine, base))} (target <= {TARGET_RATIO}x)")
    per_repeat = result["repeat_ratios"]
    console.print(f"per-repeat ratio: median {fmt_ratio(statistics.median(per_repeat))}, "
                  f"spread {fmt_ratio(min(per_repeat))} - {fmt_ratio(max(per_repeat))} ({len(per_repeat)} repeats)")
    console.print(f"import peak RSS above start: {peak_over / MiB:.0f} MiB "
                  f"(target <= file {size / MiB:.0f} MiB + {MEMORY_HEADROOM / MiB:.0f} MiB)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--source", type=Path, default=None,
                        help="torch.save file to import (written there first when missing, then kept)")
    parser.add_argument("--peak-child", nargs=2, metavar=("SOURCE", "DEST"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_child:
        print(json.dumps(peak_child(*args.peak_child)))
        return 0

    def run(workdir: Path) -> dict:
        result = run_all(args.size_gb, args.repeats, workdir, args.source)
        report(result)
        return result

    return run_in_scratch(args.dir, "ckptfmt-import-", run, args.json, console)


if __name__ == "__main__":
    sys.exit(main())
