"""The single-process durable save against the disk: ckptfmt, safetensors and a plain write, side by side.

    python bench/durable_save.py [--size-gb 1.3] [--repeats 9] [--dir /path] [--components]

The state of bench/run.py (1.34 GB of fp32, 385 tensors). Each repeat makes
content no save has seen (``refresh_content``), then runs, in an order rotated
every repeat:

- ``ckptfmt``: ``ckptfmt.save`` into a fresh repository (tensor statistics on,
  the default), and ``ckptfmt, no stats`` (``tensor_stats=False``);
- ``safetensors``: ``save_file`` then fsync of the file and its folder;
- ``write``: every tensor's bytes written to one file with ``os.write``, then
  fsync of the file and its folder: what the disk and the page cache cost.

Reported: each saver's median and range, and the per-repeat ratios of ckptfmt
to safetensors and to the plain write (median and range); ckptfmt's phases from
its manifest (spec 9.4). Then the second save: 10% of the tensors changed
(every 10th by size), ckptfmt into the repository of its first save against
full saves of the others, the same way. ``--components`` first times, on one
thread over the whole state, what a first save does per byte: copy, BLAKE3,
XXH3, the statistics, a write into the page cache.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import blake3
import torch
import xxhash
from competitors import save_safetensors
from harness import Scratch, build_state, fsync_path, refresh_content, round_robin, state_nbytes
from run import changed_keys

import ckptfmt
from ckptfmt.tensors.stats import StatsAccumulator

BLOCK = 2**20


def save_write(state: Mapping[str, torch.Tensor], out: Path, name: str) -> None:
    """Every tensor's bytes to one file, then fsync of the file and its folder."""
    path = out / f"{name}.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for tensor in state.values():
            view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(out)


def phases_of(url: str) -> dict[str, float]:
    """The save's phases (seconds) from its manifest."""
    with ckptfmt.open(url) as checkpoint:
        record = checkpoint.manifest.timing["ranks"][0]
    return {phase["name"]: phase["duration_s"] for phase in record["phases"]}


def ratio_line(label: str, ours: list[float], theirs: list[float]) -> str:
    ratios = [a / b for a, b in zip(ours, theirs)]
    return (f"  {label:32} median {statistics.median(ratios):.2f}x "
            f"(range {min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} repeats)")


def report(title: str, results: Mapping, ours: str, baselines: list[str]) -> None:
    print(title)
    for name, result in results.items():
        if result.error:
            print(f"  {name:20} FAILED {result.error}")
        elif result.times:
            print(f"  {name:20} median {statistics.median(result.times):.2f} s "
                  f"(range {min(result.times):.2f}-{max(result.times):.2f})")
    for baseline in baselines:
        print(ratio_line(f"{ours} / {baseline}", results[ours].times, results[baseline].times))


def components(state: Mapping[str, torch.Tensor]) -> None:
    """Seconds per pass over the whole state on one thread, block by block, as a first save does."""
    block = bytearray(BLOCK)
    view = memoryview(block)
    blocks = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in state.values()]
    path = Path(os.environ.get("TMPDIR", "/tmp")) / "ckptfmt-components.bin"

    def each(work: Callable[[memoryview, memoryview], object]) -> float:
        start = time.perf_counter()
        for data in blocks:
            for at in range(0, len(data), BLOCK):
                piece = data[at:at + BLOCK]
                work(piece, view[:len(piece)])
        return time.perf_counter() - start

    def copy(piece, into):
        into[:] = piece

    accumulator = StatsAccumulator(torch.float32)

    def stats(piece, into):
        accumulator.add_bytes(torch.frombuffer(piece, dtype=torch.uint8))

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        figures = {
            "copy": each(copy),
            "BLAKE3": each(lambda piece, into: blake3.blake3(piece)),
            "XXH3-128": each(lambda piece, into: xxhash.xxh3_128_digest(piece)),
            "statistics": each(stats),
            "write (page cache)": each(lambda piece, into: os.write(fd, piece)),
        }
        start = time.perf_counter()
        os.fsync(fd)
        figures["fsync of that file"] = time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()
    gb = state_nbytes(state) / 1e9
    print(f"one thread over {gb:.2f} GB, 1 MiB blocks:")
    for name, seconds in figures.items():
        print(f"  {name:20} {seconds:6.2f} s  ({gb / seconds:5.2f} GB/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.3)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--components", action="store_true")
    args = parser.parse_args()

    state = build_state(args.size_gb)
    print(f"{len(state)} tensors, {state_nbytes(state) / 1e9:.2f} GB; {args.repeats} repeats; "
          f"commit {os.popen('git rev-parse --short HEAD').read().strip()}")
    if args.components:
        components(state)
    import tempfile
    scratch = Scratch(Path(tempfile.mkdtemp(prefix="ckptfmt-durable-", dir=args.dir)))
    urls: dict[int, str] = {}
    phases: list[dict[str, float]] = []

    def ckptfmt_saver(stats: bool) -> Callable[[int], float]:
        def run(rep: int) -> float:
            out = scratch.fresh(f"ckptfmt-{stats}")
            url = f"{out}/repo/first"
            start = time.perf_counter()
            ckptfmt.save(state, url, tensor_stats=stats)
            seconds = time.perf_counter() - start
            if stats:
                urls[rep] = url
                phases.append(phases_of(url))
            return seconds
        return run

    def other(save: Callable[..., object], name: str) -> Callable[[int], float]:
        def run(rep: int) -> float:
            out = scratch.fresh(name)
            start = time.perf_counter()
            save(state, out, "state")
            return time.perf_counter() - start
        return run

    savers = {"ckptfmt": ckptfmt_saver(True), "ckptfmt, no stats": ckptfmt_saver(False),
              "safetensors": other(save_safetensors, "safetensors"), "write": other(save_write, "write")}
    first = round_robin("first save", savers, args.repeats, before_repeat=lambda rep: refresh_content(state, rep))
    report("first save into a fresh repository", first, "ckptfmt", ["safetensors", "write"])
    print(ratio_line("ckptfmt, no stats / safetensors", first["ckptfmt, no stats"].times,
                     first["safetensors"].times))
    print(ratio_line("ckptfmt, no stats / write", first["ckptfmt, no stats"].times, first["write"].times))
    print("  ckptfmt phases (median s): " + ", ".join(
        f"{name} {statistics.median(p.get(name, 0.0) for p in phases):.3f}" for name in phases[0]))

    changed = changed_keys(state)
    last = urls[max(urls)]
    repo_root = last.rsplit("/", 1)[0]

    def mutate(rep: int) -> None:
        with torch.no_grad():
            for key in changed:
                state[key].add_(1e-3)

    def second(rep: int) -> float:
        start = time.perf_counter()
        ckptfmt.save(state, f"{repo_root}/second-{rep}")
        return time.perf_counter() - start

    seconds = {"ckptfmt": second, "safetensors": other(save_safetensors, "safetensors"),
               "write": other(save_write, "write")}
    changed_bytes = sum(state[key].numel() * state[key].element_size() for key in changed)
    again = round_robin("second save", seconds, args.repeats, before_repeat=mutate)
    report(f"second save, {len(changed)} tensors changed ({changed_bytes / 1e9:.2f} GB), against full saves",
           again, "ckptfmt", ["safetensors", "write"])
    shutil.rmtree(scratch.root, ignore_errors=True)


if __name__ == "__main__":
    main()
