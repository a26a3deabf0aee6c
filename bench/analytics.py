"""How fast ``ckptfmt.analytics.tables`` turns a big run's metadata into Arrow tables, and in how much memory;
with ``--runs``, how fast many runs' incremental exports and a DuckDB query over them are.

Usage (from the repository root)::

    python bench/analytics.py [--checkpoints 1000] [--ranks 64] [--steps 100] [--repeats 3] [--dir /path]
                              [--processes N] [--vs-serial]
    python bench/analytics.py --runs 100 --checkpoints 10 --ranks 8 --steps 100 [--repeats 3]

Writes a simulated repository: manifests as a collective save on ``--ranks``
ranks writes them (per-rank save phases, one shared environment, and
``--steps`` step records per rank with 4 phases, a batch digest and a loss),
each with one small tensor, committed by ckptfmt's own writer. Then, in a
fresh process per repeat, times ``tables(repo)`` and reads its peak RSS above
the process's RSS before the call, the largest child's peak (where children
built shares of the checkpoints) and the shared memory their tables hold.
Prints the median time and rows per table; with ``--vs-serial``, each repeat
also times ``processes=1`` (the order alternated) and the per-repeat ratios.

``--runs N`` simulates N such runs in one folder (8 ranks a host, the runs
spread over 32 hosts). Each repeat copies them, exports every run to a fresh
dataset (``export_incremental``), adds one checkpoint to each run, exports
again (counting the manifests read), and times DuckDB's p99 step time per host
over every run's parts. Prints the median and range of each.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import console

PHASES = ("data", "forward", "backward", "optimizer")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoints", type=int, default=1000)
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runs", type=int, default=0, help="simulate this many runs and measure their "
                        "incremental export and a DuckDB query over them (default: one run, tables())")
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--processes", type=int, default=None, help="tables(processes=N) (default: its own, "
                        "one per core); with --vs-serial, each repeat also times processes=1, the order alternated")
    parser.add_argument("--vs-serial", action="store_true")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        return measure(args.measure, args.processes)
    root = Path(tempfile.mkdtemp(prefix="ckptfmt-analytics-bench-", dir=args.dir))
    if args.runs:
        try:
            return many_runs(root, args)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    try:
        repo = str(root / "run")
        start = time.perf_counter()
        manifest_bytes = simulate(repo, args.checkpoints, args.ranks, args.steps)
        console.print(f"simulated {args.checkpoints} checkpoints x {args.ranks} ranks x {args.steps} steps in "
                      f"{time.perf_counter() - start:.1f} s ({manifest_bytes / 2**20:.0f} MiB of manifests)")
        runs, serial = [], []
        for repeat in range(args.repeats):
            if args.vs_serial and repeat % 2:
                serial.append(_measured(repo, 1))
            runs.append(_measured(repo, args.processes))
            if args.vs_serial and not repeat % 2:
                serial.append(_measured(repo, 1))
        _report("tables()", runs)
        if serial:
            _report("tables(processes=1)", serial)
            ratios = [r["seconds"] / s["seconds"] for r, s in zip(runs, serial)]
            console.print(f"time against processes=1: median {statistics.median(ratios):.2f}x "
                          f"({min(ratios):.2f}-{max(ratios):.2f}), the order alternated")
        for name, rows in runs[0]["rows"].items():
            console.print(f"  {name}: {rows:,} rows, {runs[0]['arrow_mib'][name]:.0f} MiB in Arrow")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def many_runs(root: Path, args) -> int:
    """``--runs``: first export, export after one more checkpoint a run, and the p99 query, per repeat."""
    import duckdb

    from ckptfmt import analytics

    start = time.perf_counter()
    manifest_bytes = sum(simulate(str(root / "runs" / f"run-{r:04d}"), args.checkpoints, args.ranks, args.steps,
                                  host_base=r * args.ranks // 8) for r in range(args.runs))
    console.print(f"simulated {args.runs} runs of {args.checkpoints} checkpoints x {args.ranks} ranks x "
                  f"{args.steps} steps in {time.perf_counter() - start:.1f} s ({manifest_bytes / 2**20:.0f} MiB of "
                  "manifests)")
    query = """SELECT host, quantile_cont(duration_s, 0.99) AS p99_s
        FROM read_parquet('{}/steps/*/*.parquet', hive_partitioning = true, union_by_name = true)
        GROUP BY host ORDER BY p99_s DESC"""
    measured: dict[str, list[float]] = {"first export": [], "export after one more checkpoint a run": [],
                                        "DuckDB p99 per host": []}
    for repeat in range(args.repeats):
        runs = root / f"copy-{repeat}"
        shutil.copytree(root / "runs", runs)
        repos = sorted(runs.iterdir())
        out = root / f"dataset-{repeat}"
        start = time.perf_counter()
        first = analytics.export_incremental(repos, out)
        measured["first export"].append(time.perf_counter() - start)
        for index, repo in enumerate(repos):
            simulate(str(repo), 1, args.ranks, args.steps, first=args.checkpoints, host_base=index * args.ranks // 8)
        start = time.perf_counter()
        second = analytics.export_incremental(repos, out)
        measured["export after one more checkpoint a run"].append(time.perf_counter() - start)
        start = time.perf_counter()
        hosts = duckdb.sql(query.format(out)).fetchall()
        measured["DuckDB p99 per host"].append(time.perf_counter() - start)
        console.print(f"repeat {repeat + 1}: first export read {first.read:,} manifests, wrote "
                      f"{first.rows['steps']:,} steps; the next read {second.read:,} and wrote "
                      f"{second.rows['steps']:,}; {len(hosts)} hosts")
        shutil.rmtree(runs)
        shutil.rmtree(out)
    for what, seconds in measured.items():
        console.print(f"{what}: median {statistics.median(seconds):.2f} s over {args.repeats} repeats "
                      f"({min(seconds):.2f}-{max(seconds):.2f} s)")
    return 0


def simulate(repo_url: str, checkpoints: int, ranks: int, steps: int, *, first: int = 0, host_base: int = 0) -> int:
    """Commit ``checkpoints`` manifests shaped like a ``ranks``-rank collective save with a StepTimer, from
    checkpoint ``first`` on; ranks run 8 a host, from host ``host_base`` (of 32)."""
    from ckptfmt.format.manifest import Chunk, Manifest, Piece, ShardEntry, TensorEntry
    from ckptfmt.format.values import TensorRef, encode_tree
    from ckptfmt.metadata.environment import capture_environment
    from ckptfmt.metadata.rng import capture_rng
    from ckptfmt.metadata.step_timer import encode_steps
    from ckptfmt.repository.leases import save_lease
    from ckptfmt.repository.repository import Repository
    from ckptfmt.saving.core import commit_manifest

    repo = Repository.open(repo_url, create=True)
    environment = {**capture_environment(), "ranks": list(range(ranks))}
    rng = [capture_rng(r) for r in range(ranks)]
    chunk_hash = "0" * 64  # the manifests are what is measured: no chunk is read
    state = encode_tree({"w": TensorRef("w")}, lambda path, ref: 0)
    jitter = random.Random(0)
    total = 0
    now = time.time_ns()
    for index in range(first, first + checkpoints):
        step_zero = index * steps
        records = []
        for rank in range(ranks):
            durations = [0.1 + jitter.random() * 0.01 for _ in range(steps)]
            records.append({
                "rank": rank, "host": f"node{(host_base + rank // 8) % 32}", "start_ns": now, "total_s": 1.0,
                "phases": [{"name": p, "start_ns": now, "duration_s": 0.1} for p in
                           ("join", "prepare", "plan", "write_chunks", "sync", "environment")],
                "steps": encode_steps({
                    "step": list(range(step_zero, step_zero + steps)),
                    "start_ns": [now + int(i * 1e8) for i in range(steps)],
                    "duration_s": durations,
                    "phases": {p: [d / 4 for d in durations] for p in PHASES},
                    "batch": [jitter.randbytes(16) for _ in range(steps)],
                    "batch_size": [32] * steps,
                    "metrics": {"loss": [1.0 / (step_zero + i + 1) for i in range(steps)]},
                }),
            })
        step = step_zero + steps
        manifest = Manifest(
            name=f"step-{step:07d}",
            step=step,
            created_ns=now + index,
            parent=None,
            chunks=[Chunk(chunk_hash, "none", 4, 4)],
            tensors=[
                TensorEntry(key="w", dtype="float32", shape=(1,),
                            shards=(ShardEntry((0,), (1,), 0, (Piece(0, 0, 4),)),))
            ],
            state=state,
            user=encode_tree({}),
            rng=rng,
            environment=environment,
            topology={"world_size": ranks, "writer_ranks": [0], "ranks": [{"rank": r} for r in range(ranks)]},
            timing={"ranks": records, "steps": []},
            totals={"tensor_count": 1, "tensor_bytes": 4, "chunk_count": 1, "stored_bytes": 4, "new_bytes": 4},
        )
        total += len(manifest.to_bytes())
        with save_lease(repo) as lease:
            commit_manifest(repo, manifest, lease)
    return total


def _measured(repo: str, processes: int | None) -> dict:
    """``measure`` in a fresh process."""
    command = [sys.executable, __file__, "--measure", repo]
    if processes is not None:
        command += ["--processes", str(processes)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise SystemExit(f"the measuring process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _report(what: str, runs: list[dict]) -> None:
    seconds = statistics.median(r["seconds"] for r in runs)
    cpu = statistics.median(r["cpu_s"] for r in runs)
    peak = statistics.median(r["peak_mib"] for r in runs)
    each = ", ".join(f"{r['seconds']:.2f}" for r in runs)
    children = statistics.median(r["children_peak_mib"] for r in runs)
    shared = statistics.median(r["shared_mib"] for r in runs)
    console.print(f"{what}: median {seconds:.2f} s over {len(runs)} runs ({each} s), {cpu:.2f} s of CPU "
                  f"(children's included); peak RSS above start {peak:.0f} MiB"
                  + (f", the largest child's peak {children:.0f} MiB, its tables {shared:.0f} MiB of shared "
                     "memory mapped here" if children else ""))


def measure(repo: str, processes: int | None) -> int:
    """One timed ``tables(repo)`` in this fresh process: seconds (and CPU seconds, every thread's and the
    children's: what a busy machine disturbs less), peak RSS above start, the largest child's peak RSS
    (whole: a child starts bare), rows per table."""
    from ckptfmt import analytics

    baseline, shared = _status_kib("VmRSS"), _shared_kib()
    start, cpu = time.perf_counter(), time.process_time()
    built = analytics.tables(repo, processes=processes)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu += children.ru_utime + children.ru_stime
    peak = _status_kib("VmHWM")
    print(json.dumps({"seconds": seconds, "cpu_s": cpu, "peak_mib": (peak - baseline) / 1024,
                      "children_peak_mib": children.ru_maxrss / 1024,
                      "shared_mib": (_shared_kib() - shared) / 1024,
                      "rows": {name: table.num_rows for name, table in built.items()},
                      "arrow_mib": {name: table.nbytes / 2**20 for name, table in built.items()}}))
    return 0


def _shared_kib() -> int:
    """The machine's shared memory (/proc/meminfo Shmem): where children's tables lie, mapped by this
    process (counted in its RSS only as their pages are touched)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1])
    return 0


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


if __name__ == "__main__":
    sys.exit(main())
