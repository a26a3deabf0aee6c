"""Many small tensors (issue 31, part 2): a save and a load of N tensors of 8 floats against torch.save
+ fsync and torch.load of the same dict, their peak memory, the manifest's bytes per tensor, and its
parse against msgpack's own unpack of the same bytes (part 5), ``ckptfmt.open`` and every key against
that unpack (issue 49 part 3), and the parse of a table of sharded tensors
(format 1.14: their shard grids in the tensor columns), against the same table in 1.13's form (a row
and a grid map each).

Usage (from the repository root)::

    python bench/small_tensors.py [--tensors 100000] [--repeats 7]

Each repeat saves with both, order alternated, then loads with both, order alternated; the ratios are
per repeat (ckptfmt over torch), their median and range printed. Peak memory is each library's save
(then load) in a fresh process: its most resident memory (VmHWM) above that of a process that
builds the state (or imports the libraries) and does nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import console

import ckptfmt
from ckptfmt.format.manifest import Manifest
from ckptfmt.format.maps import unique_map


def small_state(count: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {f"blocks.{i // 100}.param{i % 100}": torch.randn(8, generator=generator) for i in range(count)}


def torch_save(state: dict, path: Path) -> None:
    with open(path, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())


def timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def child(mode: str, count: int, folder: Path) -> None:
    """One library's save or load in this process; prints the peak resident KiB above the state."""
    state = small_state(count) if mode.startswith(("save", "build")) else None
    if mode == "save-ckptfmt":
        ckptfmt.save(state, str(folder / "repo" / "a"))
    elif mode == "save-torch":
        torch_save(state, folder / "state.pt")
    elif mode == "load-ckptfmt":
        ckptfmt.load(str(folder / "repo" / "a"))
    elif mode == "load-torch":
        torch.load(folder / "state.pt")
    print(high_water_kib())


def high_water_kib() -> int:
    """This process's peak resident memory (VmHWM: ``ru_maxrss`` would carry the launching process's
    peak over from before the exec)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def peak_kib(mode: str, count: int, folder: Path) -> int:
    if mode == "save-ckptfmt":
        shutil.rmtree(folder / "repo", ignore_errors=True)
    result = subprocess.run([sys.executable, __file__, "--child", mode, "--tensors", str(count), "--folder",
                             str(folder)], capture_output=True, text=True, check=True)
    return int(result.stdout.split()[-1])


def parse_ratio(data: bytes, repeats: int, unpacked: bytes | None = None, entries: bool = False,
                against: bytes | None = None) -> tuple[float, float, list[float]]:
    """Median seconds of msgpack's unpack (of ``unpacked``, by default ``data`` itself; with ``against``,
    ckptfmt's parse of those bytes instead) and of ckptfmt's parse of ``data`` (and, with ``entries``,
    every entry of its tensor table read, which builds them), and the per-repeat ratios; both with
    Python's cyclic collector off (ckptfmt pauses it while it parses)."""
    gc.disable()
    unpacks, parses, ratios = [], [], []
    baseline = (lambda: Manifest.from_bytes(against, "bench")) if against is not None \
        else (lambda: msgpack.unpackb(unpacked or data, raw=False, strict_map_key=False))
    for repeat in range(repeats):
        times = {}
        for which in ((0, 1) if repeat % 2 == 0 else (1, 0)):
            times[which] = timed((baseline, lambda: Manifest.from_bytes(data, "bench") if not entries
                                  else list(Manifest.from_bytes(data, "bench").tensors))[which])
        unpacks.append(times[0])
        parses.append(times[1])
        ratios.append(times[1] / times[0])
    gc.enable()
    return statistics.median(unpacks), statistics.median(parses), ratios


def open_ratio(url: str, data: bytes, repeats: int) -> tuple[float, float, list[float]]:
    """Median seconds of msgpack's unpack of ``data`` (the manifest's bytes) and of ``ckptfmt.open(url)``
    and its ``keys()`` (the commit record and manifest read from the page cache, the manifest hashed and
    parsed, every key listed), and the per-repeat ratios; the cyclic collector off, as in ``parse_ratio``."""
    def open_and_list() -> None:
        with ckptfmt.open(url) as reader:
            reader.keys()
    gc.disable()
    unpacks, opens, ratios = [], [], []
    for repeat in range(repeats):
        times = {}
        for which in ((0, 1) if repeat % 2 == 0 else (1, 0)):
            times[which] = timed((lambda: msgpack.unpackb(data, raw=False, strict_map_key=False), open_and_list)[which])
        unpacks.append(times[0])
        opens.append(times[1])
        ratios.append(times[1] / times[0])
    gc.enable()
    return statistics.median(unpacks), statistics.median(opens), ratios


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x (range {min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--child")
    parser.add_argument("--folder")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.tensors, Path(args.folder))
        return
    state = small_state(args.tensors)
    with tempfile.TemporaryDirectory(prefix="ckptfmt-small-") as scratch:
        folder = Path(scratch)
        saves: dict[str, list[float]] = {"ckptfmt": [], "torch": []}
        loads: dict[str, list[float]] = {"ckptfmt": [], "torch": []}
        for repeat in range(args.repeats):
            order = ("ckptfmt", "torch") if repeat % 2 == 0 else ("torch", "ckptfmt")
            shutil.rmtree(folder / "repo", ignore_errors=True)
            for name in order:
                saves[name].append(timed(lambda name=name: ckptfmt.save(state, str(folder / "repo" / "a"))
                                         if name == "ckptfmt" else torch_save(state, folder / "state.pt")))
            for name in order:
                loads[name].append(timed(lambda name=name: ckptfmt.load(str(folder / "repo" / "a"))
                                         if name == "ckptfmt" else torch.load(folder / "state.pt")))
        save_ratios = [a / b for a, b in zip(saves["ckptfmt"], saves["torch"])]
        load_ratios = [a / b for a, b in zip(loads["ckptfmt"], loads["torch"])]
        console.print(f"{args.tensors} tensors of 8 floats, {args.repeats} repeats, order alternated")
        console.print(f"save: ckptfmt {statistics.median(saves['ckptfmt']):.2f} s, torch.save + fsync "
                      f"{statistics.median(saves['torch']):.2f} s: {spread(save_ratios)}")
        console.print(f"load: ckptfmt {statistics.median(loads['ckptfmt']):.2f} s, torch.load "
                      f"{statistics.median(loads['torch']):.2f} s: {spread(load_ratios)}")
        built, imported = peak_kib("build", args.tensors, folder), peak_kib("nothing", args.tensors, folder)
        peaks = {mode: peak_kib(mode, args.tensors, folder) - (built if mode.startswith("save") else imported)
                 for mode in ("save-ckptfmt", "save-torch", "load-ckptfmt", "load-torch")}
        mib = {mode: peak / 1024 for mode, peak in peaks.items()}
        console.print(f"peak memory above the state: save {mib['save-ckptfmt']:.0f} MiB vs {mib['save-torch']:.0f} "
                      f"MiB ({mib['save-ckptfmt'] / max(mib['save-torch'], 1e-3):.2f}x); "
                      f"load {mib['load-ckptfmt']:.0f} MiB vs {mib['load-torch']:.0f} MiB")
        with ckptfmt.open(str(folder / "repo" / "a")) as reader:
            manifest = reader.manifest
        data = manifest.to_bytes()
        keys = sum(len(entry.key.encode()) for entry in manifest.tensors)
        doc = msgpack.unpackb(data, raw=False, strict_map_key=False, object_pairs_hook=unique_map)
        table = len(msgpack.packb(doc["tensors"], use_bin_type=True)) - keys
        stats = len(msgpack.packb(doc["tensors"].get("stats", {}), use_bin_type=True)) if isinstance(
            doc["tensors"], dict) else sum(len(msgpack.packb(t.stats)) for t in manifest.tensors if t.stats)
        count = len(manifest.tensors)
        console.print(f"manifest: {len(data) / 2**20:.1f} MiB, its tensor table {table / count:.0f} bytes per "
                      f"tensor beyond its key (statistics {stats / count:.0f} of them)")
        timed_parse("manifest parse", data, args.repeats)
        unpack, opened, ratios = open_ratio(str(folder / "repo" / "a"), data, args.repeats)
        console.print(f"ckptfmt.open and every key: {opened * 1e3:.1f} ms against msgpack's unpack of the manifest "
                      f"{unpack * 1e3:.2f} ms: {spread(ratios)} per repeat")
        timed_parse("manifest parse, then every entry read (built)", data, args.repeats, entries=True)
        rows = dataclasses.replace(manifest, version=(1, 11)).to_bytes()  # the same table, one map per tensor
        timed_parse(f"manifest parse against msgpack's unpack of the same table as rows (1.11, "
                    f"{len(rows) / 2**20:.1f} MiB)", data, args.repeats, unpacked=rows)
        sharded = sharded_manifest(folder / "sharded")
        timed_parse(f"manifest of {SHARDED[0]:,} tensors sharded over {SHARDED[1]} ranks (1.14, grids in the "
                    f"columns, {len(sharded) / 2**20:.2f} MiB)", sharded, args.repeats)
        timed_parse("  parse, then every entry read (a shard grid built each)", sharded, args.repeats, entries=True)
        rows = dataclasses.replace(Manifest.from_bytes(sharded, "bench"), version=(1, 13)).to_bytes()
        timed_parse(f"  the same table as 1.13 wrote it (a row and a grid map a tensor, {len(rows) / 2**20:.2f} "
                    "MiB)", rows, args.repeats)
        timed_parse("  1.14's parse against 1.13's", sharded, args.repeats, against=rows)


def timed_parse(what: str, data: bytes, repeats: int, **options) -> None:
    """Print ``parse_ratio``'s medians and per-repeat ratios for ``data`` (``options``: its own)."""
    baseline, parse, ratios = parse_ratio(data, repeats, **options)
    against = "ckptfmt's parse of those bytes" if "against" in options else "msgpack's unpack"
    console.print(f"{what}: parse {parse * 1e3:.1f} ms against {against} {baseline * 1e3:.2f} ms: "
                  f"{spread(ratios)} per repeat")


#: The sharded table's tensors and ranks (each tensor's shards a grid: spec 6.11, in columns from 1.14).
SHARDED = (5_000, 4)


def sharded_manifest(folder: Path) -> bytes:
    """The manifest of a state of ``SHARDED`` tensors, each cut in rows over its ranks (as a collective
    save of DTensors records them), saved by this process."""
    tensors, ranks = SHARDED
    state = {f"layers.{index}.weight": ckptfmt.Sharded((ranks * 4, 8), [
        ckptfmt.Shard((rank * 4, 0), torch.full((4, 8), float(rank)), rank) for rank in range(ranks)])
        for index in range(tensors)}
    ckptfmt.save(state, str(folder / "a"))
    with ckptfmt.open(str(folder / "a")) as reader:
        return reader.manifest.to_bytes()


if __name__ == "__main__":
    main()
