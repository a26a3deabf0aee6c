"""What tensor statistics (spec 6.10) cost a save: the durable save of the benchmark state with and
without them, and the manifest bytes they add per tensor.

Usage (from the repository root)::

    python bench/tensor_stats.py [--size-gb 1.3] [--repeats 7]

Each repeat saves the same state twice into fresh repositories, once with
``tensor_stats=True`` (the default) and once with ``tensor_stats=False``, in an
order that alternates between repeats; the content changes before every save,
so that neither save finds the other's bytes in the fingerprint cache. Prints
the median of the per-repeat ratios (with, over without) and their range, the
median times, and what the statistics alone cost one core on the same state.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Scratch, build_state, console, refresh_content, state_nbytes

import ckptfmt
from ckptfmt.tensors.stats import tensor_stats


def timed_save(state: dict, scratch: Scratch, slot: str, with_stats: bool) -> tuple[float, int]:
    """Seconds of one durable save into a fresh repository, and its manifest's size."""
    url = str(scratch.fresh(slot) / "repo" / "step-1")
    start = time.perf_counter()
    ckptfmt.save(state, url, tensor_stats=with_stats)
    seconds = time.perf_counter() - start
    with ckptfmt.open(url) as reader:
        return seconds, len(reader.manifest.to_bytes())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.3)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    state = build_state(args.size_gb)
    console.print(f"state: {len(state)} fp32 tensors, {state_nbytes(state) / 1e9:.2f} GB")
    times: dict[bool, list[float]] = {True: [], False: []}
    manifest: dict[bool, int] = {}
    ratios = []
    tag = 0
    with tempfile.TemporaryDirectory(prefix="ckptfmt-bench-stats-", dir=Path.cwd()) as root:
        scratch = Scratch(Path(root))
        for repeat in range(args.repeats + 1):  # the first is a warm-up, not counted
            seconds = {}
            for with_stats in ((True, False) if repeat % 2 else (False, True)):
                tag += 1
                refresh_content(state, tag)
                seconds[with_stats], manifest[with_stats] = timed_save(state, scratch, str(with_stats), with_stats)
            if repeat:
                for with_stats, value in seconds.items():
                    times[with_stats].append(value)
                ratios.append(seconds[True] / seconds[False])
                console.print(f"repeat {repeat}: with {seconds[True]:.3f} s, without {seconds[False]:.3f} s, "
                              f"ratio {ratios[-1]:.3f}")
    start = time.perf_counter()
    for tensor in state.values():
        tensor_stats(tensor)
    alone = time.perf_counter() - start
    console.print(f"durable save, median of {args.repeats}: with statistics {statistics.median(times[True]):.3f} s, "
                  f"without {statistics.median(times[False]):.3f} s")
    console.print(f"ratio with/without, median of per-repeat ratios: {statistics.median(ratios):.3f} "
                  f"(range {min(ratios):.3f}-{max(ratios):.3f})")
    console.print(f"manifest: {manifest[True]} bytes with, {manifest[False]} without: "
                  f"{(manifest[True] - manifest[False]) / len(state):.0f} bytes per tensor")
    console.print(f"the statistics alone, one pass on one thread: {alone:.3f} s "
                  f"({state_nbytes(state) / alone / 1e9:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
