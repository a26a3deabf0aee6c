"""A tier in memory against the shared tier (issue 48, part 3): restores and saves of a few hundred MB.

    python bench/memory_tier.py [--hosts 2] [--ranks 1] [--mb 256] [--repeats 7]

On hosts simulated with network namespaces (tests/support/hosts.py: each host its own hostname,
network and memory, a tmpfs mounted at one path on every host; needs root and iproute2), one job
under ``torchrun --nnodes HOSTS`` holds a state of ``--mb`` MiB (fp32 DTensors sharded over every
rank, so each node holds its share and sends it to its peer) and two managers:

- *memory*: ``CheckpointManager(tiers=[Tier(MEMORY, scope="node", survives=1), DRAIN])``, each node's
  chunks in its own memory, copied to the next node's memory and drained to a folder on disk;
- *shared*: ``CheckpointManager(tiers=[SHARED])``, a folder on disk every host sees.

Each repeat saves once with each (every weight changed before each save), in alternating order, and
times how long ``manager.save`` blocks the loop (synchronous saves: until every node has committed;
the peer copy and the drain run after it, and ``wait()`` is timed apart); then restores the newest
checkpoint of each in a new manager, in the same order, timing ``restore`` until every rank is done.
Before each restore from the shared tier, its files are dropped from the page cache (fsync, then
``posix_fadvise(DONTNEED)``, bench/harness.py's ``evict``): what a restarted job on other machines
finds. The memory tier is never evicted: it is memory. Prints the median of each and the median and
range of the per-repeat ratios memory/shared.

Where no simulated hosts can be made, the same job runs in this one process, on two repositories: a
node-scoped tier in a folder under /dev/shm (no peers) and a folder on disk.

What the simulation cannot show: every host's memory is this machine's memory and the "shared" folder
is on this machine's own disk (a virtual disk here), with no network between them, and the hosts share
the machine's cores. A real shared filesystem adds the network and other jobs' traffic; a node's
memory stays memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from harness import evict

import ckptfmt
from ckptfmt.metadata.resumes import pending_resumes

ROOT = Path(__file__).resolve().parents[1]
TENSOR_MIB = 16


# --------------------------------------------------------------------------------- the job
def job(memory: str, drain: str, shared: str, size_mb: int, repeats: int, out: str) -> None:
    """On every rank (or in one process where there are no ranks): the saves and restores above; rank 0
    writes the figures to ``out`` as JSON."""
    ranks = "RANK" in os.environ
    if ranks:
        dist.init_process_group("gloo")
    state = make_state(size_mb, ranks)
    modes = {"memory": [ckptfmt.Tier(memory, scope="node", survives=1), drain], "shared": [shared]}
    figures: dict[str, dict[str, list]] = {mode: {"stall_s": [], "wait_s": [], "restore_s": [], "from": []}
                                           for mode in modes}
    managers = {mode: ckptfmt.CheckpointManager(tiers=tiers, keep_last=2, housekeeping="thread")
                for mode, tiers in modes.items()}
    try:
        for repeat in range(repeats):
            order = list(modes) if repeat % 2 == 0 else list(reversed(modes))
            for mode in order:
                save_timed(managers[mode], state, repeat + 1, figures[mode])
            for mode in order:
                if mode == "shared" and rank() == 0:
                    evict(shared)
                restore_timed(modes[mode], state, repeat + 1, figures[mode])
                figures[mode]["from"].append(pending_resumes()[-1]["from"]["repository"])
    finally:
        for manager in managers.values():
            manager.close()
    if rank() == 0:
        Path(out).write_text(json.dumps(figures))
    if ranks:
        dist.destroy_process_group()


def save_timed(manager: ckptfmt.CheckpointManager, state: dict, step: int, figures: dict[str, list]) -> None:
    """On every rank: ``state`` changed (every weight), then saved by ``manager`` at ``step``; how long the
    save blocked the loop and the ``wait()`` after it took, the slowest rank's, appended to ``figures``."""
    with torch.no_grad():
        for value in state.values():
            value.add_(1.0)
    barrier()
    began = time.perf_counter()
    manager.save(step, state)
    saved = time.perf_counter()
    manager.wait()
    barrier()
    figures["stall_s"].append(slowest(saved - began))
    figures["wait_s"].append(slowest(time.perf_counter() - saved))


def restore_timed(tiers: list, state: dict, step: int, figures: dict[str, list]) -> list[str]:
    """On every rank: a new manager over ``tiers`` restores ``state``, which must come back at ``step``;
    the time until every rank is done appended to ``figures``; what it fetched from other nodes."""
    with ckptfmt.CheckpointManager(tiers=tiers, keep_last=2, housekeeping="thread") as manager:
        barrier()
        began = time.perf_counter()
        manager.restore(into=state)
        barrier()
        figures["restore_s"].append(time.perf_counter() - began)
        assert manager.restored_step == step, (tiers, manager.restored_step)
        return manager.fetched_from_peers


def make_state(size_mb: int, ranks: bool) -> dict:
    """``size_mb`` MiB of fp32 in tensors of 16 MiB, each sharded over every rank (a DTensor) under
    torch.distributed."""
    torch.manual_seed(0)  # the same whole tensors on every rank, each keeping its shard
    tensors = {f"layer{i}": torch.randn(TENSOR_MIB * 2**18) for i in range(max(1, size_mb // TENSOR_MIB))}
    if not ranks:
        return tensors
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {key: distribute_tensor(value, mesh, [Shard(0)]) for key, value in tensors.items()}


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def slowest(seconds: float) -> float:
    """The longest of every rank's ``seconds``."""
    if not dist.is_initialized():
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


# ------------------------------------------------------------------------------- the driver
def on_hosts(args, folder: Path) -> tuple[dict | None, str]:
    """The job on simulated hosts; its figures and what ran it (None where no hosts can be made)."""
    sys.path.insert(0, str(ROOT))
    from tests.support.hosts import HostsUnavailable, SimulatedHosts

    hosts = SimulatedHosts(args.hosts, folder / "hosts", memory_size=args.memory_size)
    try:
        hosts.start()
    except HostsUnavailable as exc:
        print(f"no simulated hosts ({exc}): one process, two repositories", file=sys.stderr)
        return None, ""
    try:
        out = folder / "figures.json"
        hosts.torchrun(str(Path(__file__).resolve()), args.ranks, "job", str(hosts.memory / "run"),
                       str(folder / "drain"), str(hosts.shared / "run"), str(args.mb), str(args.repeats), str(out),
                       timeout=600)
        kind = "tmpfs per host" if hosts.memory_is_tmpfs else "a folder under /dev/shm per host"
        return json.loads(out.read_text()), f"{args.hosts} simulated hosts x {args.ranks} ranks, memory: {kind}"
    finally:
        hosts.close()


def in_one_process(args, folder: Path) -> tuple[dict, str]:
    memory = Path(tempfile.mkdtemp(prefix="ckptfmt-bench-", dir="/dev/shm"))
    try:
        out = folder / "figures.json"
        job(str(memory / "run"), str(folder / "drain"), str(folder / "shared"), args.mb, args.repeats, str(out))
        return json.loads(out.read_text()), f"one process, memory: {memory}"
    finally:
        shutil.rmtree(memory, ignore_errors=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "job":
        memory, drain, shared, size_mb, repeats, out = sys.argv[2:8]
        return job(memory, drain, shared, int(size_mb), int(repeats), out)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=1, help="ranks per host")
    parser.add_argument("--mb", type=int, default=256, help="the whole state, MiB (each node holds its share)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--memory-size", default="4g", help="each simulated host's memory (tmpfs size=)")
    parser.add_argument("--one-process", action="store_true", help="no simulated hosts, even where they can be made")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as name:
        folder = Path(name)
        figures, what = (None, "") if args.one_process else on_hosts(args, folder)
        if figures is None:
            figures, what = in_one_process(args, folder)
    report(figures, what, args)


def report(figures: dict, what: str, args) -> None:
    sharded = "" if what.startswith("one process") else " sharded over the ranks"
    print(f"{what}; {args.mb} MiB state{sharded}, {args.repeats} repeats (alternating order)")
    for mode in ("memory", "shared"):
        print(f"  restored from ({mode}): {', '.join(sorted(set(figures[mode]['from'])))}")
    for what_, label in (("restore_s", "restore"), ("stall_s", "save blocks"), ("wait_s", "wait() after")):
        for mode in ("memory", "shared"):
            values = figures[mode][what_]
            print(f"  {label:12} {mode:7} median {statistics.median(values) * 1000:8.1f} ms  "
                  f"(range {min(values) * 1000:.1f}-{max(values) * 1000:.1f})")
        ratios = [m / s for m, s in zip(figures["memory"][what_], figures["shared"][what_])]
        print(f"  {label:12} memory/shared: median {statistics.median(ratios):.2f}x "
              f"(range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
