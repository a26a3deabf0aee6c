"""Benchmark ckptfmt's collective save, resharding load and async save against DCP on 4 gloo ranks.

Usage (from the repository root)::

    python bench/distributed.py [--size-gb 1.3] [--repeats 3] [--dir /path] [--json PATH]

After one untimed warm-up round of each, a state of ``--size-gb`` fp32 (20 tensors of 4096 x N) held as DTensors sharded
(Shard(0)) over 4 ranks started by torchrun. Each repeat, in rotating order,
with new content before every save (an untimed ``add_`` on every shard: ckptfmt's saves share a repository,
and a save whose bytes an earlier one stored writes nothing, which would time deduplication, not saving):

1. durable collective save: ``ckptfmt.save`` vs ``dcp.save`` with
   ``FileSystemWriter`` (fsync on, 2 threads per rank, as bench/run.py);
2. the async stall (how long the call blocks the training loop):
   ``ckptfmt.async_save`` vs ``dcp.async_save`` vs a bare ``copy_`` of every
   shard into preallocated buffers; and the background time (from the call's return
   until committed; also from the call) compared with the synchronous save;
3. the training loop during a background save: 20 single-thread matmuls, then a
   pure-Python loop (it holds the GIL throughout), timed while ckptfmt's background
   thread saves vs while nothing does: whether a thread is enough or a process is needed.

Then 2 ranks load the last checkpoint of each into DTensors on a 2-rank mesh
(resharding 4 -> 2), page cache evicted before each: ``ckptfmt.load(into=)``
vs ``dcp.load`` with ``FileSystemReader``. Times are the slowest rank's,
medians over the repeats; ratios are ckptfmt / competitor within each repeat,
their median and range (this disk's speed drifts by 2-3x between repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import console, evict, fmt_ratio, fmt_time

TENSORS = 20
COLUMNS = 4096


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--role", choices=["save", "load"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "save":
        return role_save(args)
    if args.role == "load":
        return role_load(args)
    root = Path(tempfile.mkdtemp(prefix="ckptfmt-dist-bench-", dir=args.dir))
    try:
        figures = {}
        for role, ranks in (("save", 4), ("load", 2)):
            out = root / f"{role}.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                       __file__, "--role", role, "--out", str(out), "--size-gb", str(args.size_gb),
                       "--repeats", str(args.repeats), "--dir", str(root)]
            subprocess.run(command, check=True, timeout=3600, env={**os.environ, "OMP_NUM_THREADS": "1"})
            figures.update(json.loads(out.read_text()))
        report(figures, args.size_gb)
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def report(figures: dict, size_gb: float) -> None:
    from rich.table import Table

    def median(name: str) -> float:
        return statistics.median(figures[name])

    table = Table(title=f"4 gloo ranks, {size_gb:g} GB state (slowest rank; medians of {len(figures['ckptfmt save'])} "
                        "repeats; ratio: median of the per-repeat ratios, min-max)", title_justify="left")
    for column in ("measure", "ckptfmt", "competitor", "ratio", "range", "target"):
        table.add_column(column, justify="left" if column == "measure" else "right")
    rows = [
        ("durable save", "ckptfmt save", "dcp save", "<= 1.0x"),
        ("load resharded 4 -> 2", "ckptfmt load", "dcp load", "<= 1.0x"),
        ("async stall vs bare copy_", "ckptfmt async stall", "bare copy", "<= 1.5x"),
        ("async stall vs dcp.async_save", "ckptfmt async stall", "dcp async stall", "<= 1.0x"),
        ("async background (return to commit) vs sync save", "ckptfmt async background", "ckptfmt save",
         "<= 1.2x"),
        ("async call to commit vs sync save", "ckptfmt async total", "ckptfmt save", "-"),
        ("loop step (matmuls) during a background save", "loop during save", "loop idle", "-"),
        ("pure-Python step during a background save", "python during save", "python idle", "-"),
    ]
    for label, ours, theirs, target in rows:
        # Competitors of one repeat run back to back: their ratio is spared the disk's slow drifts.
        ratios = [a / b for a, b in zip(figures[ours], figures[theirs])]
        table.add_row(label, fmt_time(median(ours)), f"{fmt_time(median(theirs))} ({theirs})",
                      fmt_ratio(statistics.median(ratios)), f"{fmt_ratio(min(ratios))}-{fmt_ratio(max(ratios))}",
                      target)
    console.print(table)
    console.print(f"dcp async total (until committed): {fmt_time(median('dcp async total'))}")


# -- inside torchrun ------------------------------------------------------------------------------
def _setup(size_gb: float):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    rows = int(size_gb * 1e9 / 4 / COLUMNS / TENSORS) // 4 * 4  # divisible by 4 and by 2

    def state_of(fill) -> dict:
        model = {}
        for index in range(TENSORS):
            local = fill((rows // world, COLUMNS), index)
            model[f"layer{index}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                                shape=(rows, COLUMNS), stride=(COLUMNS, 1))
        return {"model": model, "step": 0}
    return dist, rank, world, state_of


def _slowest(dist, seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _timed(dist, run) -> float:
    dist.barrier()
    start = time.perf_counter()
    run()
    return _slowest(dist, time.perf_counter() - start)


def _loop_step() -> float:
    """A stand-in for a training step on this rank's thread: 20 single-thread matmuls (they release the GIL)."""
    a = torch.randn(384, 384)
    start = time.perf_counter()
    for _ in range(20):
        a = torch.tanh(a @ a)
    return time.perf_counter() - start


def _python_step() -> float:
    """Pure-Python work on this rank's thread (a data loader's collate, a logger): it needs the GIL
    throughout, so it shows what a background thread holding the GIL would cost the loop."""
    start = time.perf_counter()
    total = 0
    for i in range(300_000):
        total += i * i
    return time.perf_counter() - start


def role_save(args) -> int:
    import torch.distributed.checkpoint as dcp

    import ckptfmt

    dist, rank, world, state_of = _setup(args.size_gb)
    generator = torch.Generator().manual_seed(rank)
    state = state_of(lambda shape, index: torch.randn(shape, generator=generator))
    shards = [t.to_local() for t in state["model"].values()]
    buffers = [torch.empty_like(t) for t in shards]
    root = Path(args.dir)
    times: dict[str, list[float]] = {name: [] for name in (
        "ckptfmt save", "dcp save", "bare copy", "ckptfmt async stall", "ckptfmt async background",
        "ckptfmt async total", "dcp async stall",
        "dcp async total", "loop during save", "loop idle", "python during save", "python idle")}

    state_bytes = sum(t.numel() * t.element_size() for t in state["model"].values())

    def wrote_everything(url: Path) -> None:
        """Refuse a timing whose save stored less than the state: it would time deduplication."""
        if rank == 0:
            new_bytes = ckptfmt.open(url).metadata["stats"]["new_bytes"]
            if new_bytes < state_bytes:
                raise SystemExit(f"{url} wrote {new_bytes} of {state_bytes} bytes: the timing is not of a full save")

    def ckptfmt_save(rep: int) -> None:
        url = root / "ckptfmt" / f"s{rep}"
        times["ckptfmt save"].append(_timed(dist, lambda: ckptfmt.save(state, url)))
        wrote_everything(url)

    def dcp_save(rep: int) -> None:
        writer = dcp.FileSystemWriter(root / "dcp" / f"s{rep}", thread_count=2)
        times["dcp save"].append(_timed(dist, lambda: dcp.save(state, storage_writer=writer)))

    def bare_copy(rep: int) -> None:
        times["bare copy"].append(_timed(dist, lambda: [b.copy_(s) for b, s in zip(buffers, shards)]))

    def ckptfmt_async(rep: int) -> None:
        handle = []

        def call() -> None:
            handle.append(time.perf_counter())
            handle.append(ckptfmt.async_save(state, root / "ckptfmt" / f"a{rep}"))
            handle.append(time.perf_counter())  # returned: the background part starts
        times["ckptfmt async stall"].append(_timed(dist, call))
        called, future, returned = handle
        times["loop during save"].append(_loop_step())
        times["python during save"].append(_python_step())
        future.result()
        committed = time.perf_counter()
        times["ckptfmt async background"].append(_slowest(dist, committed - returned))
        times["ckptfmt async total"].append(_slowest(dist, committed - called))
        times["loop idle"].append(_loop_step())
        times["python idle"].append(_python_step())
        wrote_everything(root / "ckptfmt" / f"a{rep}")

    # DCP's background thread runs collectives: on a group of its own, as DCP advises, or they
    # interleave with the timing collectives of the main thread on the default group (a hang).
    async_group = dist.new_group(backend="gloo")

    def dcp_async(rep: int) -> None:
        handle = []
        writer = dcp.FileSystemWriter(root / "dcp" / f"a{rep}", thread_count=2)
        times["dcp async stall"].append(_timed(dist, lambda: handle.append(
            dcp.async_save(state, storage_writer=writer, process_group=async_group))))
        start = time.perf_counter()
        handle[0].result()
        times["dcp async total"].append(times["dcp async stall"][-1] + _slowest(dist, time.perf_counter() - start))

    def fresh(competitor, rep: int) -> None:
        with torch.no_grad():
            for shard in shards:
                shard.add_(1.0)  # new content: every save writes every byte
        competitor(rep)

    competitors = [ckptfmt_save, dcp_save, bare_copy, ckptfmt_async, dcp_async]
    for competitor in competitors:  # warm-up, untimed: thread pools, process groups, first-touch buffers
        fresh(competitor, -1)
    for values in times.values():
        values.clear()
    for rep in range(args.repeats):
        shift = rep % len(competitors)
        for competitor in competitors[shift:] + competitors[:shift]:
            fresh(competitor, rep)
        if rank == 0:
            _prune(root, keep=rep == args.repeats - 1)
        dist.barrier()
    if rank == 0:
        Path(args.out).write_text(json.dumps(times))
        print(json.dumps({k: [round(v, 3) for v in vs] for k, vs in times.items()}), file=sys.stderr)
    dist.destroy_process_group()
    return 0


def _prune(root: Path, keep: bool) -> None:
    """Remove this repeat's checkpoints but, after the last repeat, the ones the load phase reads."""
    if keep:
        return
    shutil.rmtree(root / "dcp", ignore_errors=True)
    shutil.rmtree(root / "ckptfmt", ignore_errors=True)


def role_load(args) -> int:
    import torch.distributed.checkpoint as dcp

    import ckptfmt

    dist, rank, world, state_of = _setup(args.size_gb)
    state = state_of(lambda shape, index: torch.zeros(shape))
    root = Path(args.dir)
    last = args.repeats - 1
    ckptfmt_url, dcp_folder = root / "ckptfmt" / f"s{last}", root / "dcp" / f"s{last}"
    times: dict[str, list[float]] = {"ckptfmt load": [], "dcp load": []}
    loaders = {
        "ckptfmt load": lambda: ckptfmt.load(ckptfmt_url, into=state),
        "dcp load": lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(dcp_folder)),
    }
    names = list(loaders)
    for rep in range(args.repeats):
        for name in names[rep % 2:] + names[:rep % 2]:
            if rank == 0:
                evict(root)
            times[name].append(_timed(dist, loaders[name]))
    if rank == 0:
        Path(args.out).write_text(json.dumps(times))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
