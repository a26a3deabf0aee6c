"""A lost node rebuilt from parity across nodes, against a refill from a peer's copy and a restore from the
shared tier (issue 48, part 2): times, and the bytes each node tier stores.

    python bench/node_parity.py [--hosts 4] [--mb 512] [--repeats 5]

On hosts simulated with network namespaces (tests/support/hosts.py; needs root and iproute2), one job of
one rank per host holds a state of ``--mb`` MiB (fp32 DTensors sharded over the ranks: each node holds its
share) and three managers:

- *parity*: ``tiers=[Tier(LOCAL/parity, scope="node", redundancy="parity", survives=1)]``;
- *copies*: ``tiers=[Tier(LOCAL/copies, scope="node", survives=1)]`` (a full copy on the next node);
- *shared*: ``tiers=[SHARED]``, a folder every host sees.

Each repeat saves once with each (weights changed before each), in alternating order, timing how long
``save`` blocks the loop and the ``wait()`` after it (the parity or the copies, on the leaders' thread).
Then the third host's node tiers are wiped, and each manager's newest checkpoint is restored by a new
manager, timing ``restore`` until every rank is done: the parity tier rebuilds the third node's rows from
the others' data and parity, the copies tier fetches them from the copy, the shared tier reads its
files, dropped from the page cache first (what a restarted job on other machines finds; the node tiers
are left as they are: the surviving nodes were not rebooted). Prints medians, ranges and per-repeat
ratios, and the bytes each node tier holds beside its own data, summed over the nodes.

What the simulation cannot show: the hosts share this machine's 2 cores, disk and memory, and their
network is a bridge in memory, so the rebuild's transfers and zfec's work compete with every other host.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from harness import evict
from memory_tier import make_state, restore_timed, save_timed

import ckptfmt
from ckptfmt.format.node_parity import NodeParityRecord, record_key
from ckptfmt.repository.copies import copy_records

ROOT = Path(__file__).resolve().parents[1]
MODES = ("parity", "copies", "shared")
#: The host whose node tiers are wiped before each restore.
WIPED = 2


def job(local: str, shared: str, size_mb: int, repeats: int, out: str) -> None:
    """On every rank: the saves, wipes and restores above; rank 0 writes the figures to ``out``."""
    dist.init_process_group("gloo")
    state = make_state(size_mb, True)
    tiers = {"parity": [ckptfmt.Tier(f"{local}/parity", scope="node", redundancy="parity", survives=1)],
             "copies": [ckptfmt.Tier(f"{local}/copies", scope="node", survives=1)],
             "shared": [shared]}
    figures: dict = {mode: {"stall_s": [], "wait_s": [], "restore_s": [], "fetched": []} for mode in MODES}
    managers = {mode: ckptfmt.CheckpointManager(tiers=tiers[mode], keep_last=1, housekeeping="thread")
                for mode in MODES}
    try:
        for repeat in range(repeats):
            order = list(MODES) if repeat % 2 == 0 else list(reversed(MODES))
            for mode in order:
                save_timed(managers[mode], state, repeat + 1, figures[mode])
            figures["bytes"] = node_bytes(local)
            if dist.get_rank() == WIPED:
                for mode in ("parity", "copies"):
                    shutil.rmtree(f"{local}/{mode}")
            for mode in order:
                if mode == "shared" and dist.get_rank() == 0:
                    evict(shared)
                figures[mode]["fetched"] = restore_timed(tiers[mode], state, repeat + 1, figures[mode])
    finally:
        for manager in managers.values():
            manager.close()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(figures))
    dist.destroy_process_group()


def node_bytes(local: str) -> dict[str, int]:
    """Summed over the nodes, for the newest checkpoint: each node's own rows, the parity it keeps, and the
    copies of other nodes' rows it keeps."""
    host = ckptfmt.Repository.open(f"{local}/parity")
    record = host.commits()[-1]
    manifest = host.manifest(record.name)
    me = os.uname().nodename
    own = sum(manifest.chunks[row].stored_size for row in manifest.placement.node(me).rows)
    parity = NodeParityRecord.from_bytes(host.storage.read(record_key(record.name, me), max_size=1 << 26), me)
    copies = ckptfmt.Repository.open(f"{local}/copies")
    latest = copies.commits()[-1]
    copied = sum(c.stored_bytes for c in copy_records(copies, latest.name, latest.manifest_hash).values())
    totals = torch.tensor([own, parity.stored_bytes, copied], dtype=torch.float64)
    dist.all_reduce(totals)
    return dict(zip(("data", "parity", "copies"), map(int, totals.tolist())))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "job":
        local, shared, size_mb, repeats, out = sys.argv[2:7]
        return job(local, shared, int(size_mb), int(repeats), out)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--mb", type=int, default=512, help="the whole state, MiB (each node holds its share)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.support.hosts import SimulatedHosts

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as name:
        folder = Path(name)
        hosts = SimulatedHosts(args.hosts, folder / "hosts")
        hosts.start()  # HostsUnavailable says why, where this machine cannot
        try:
            out = folder / "figures.json"
            hosts.torchrun(str(Path(__file__).resolve()), 1, "job", str(hosts.local), str(hosts.shared / "run"),
                           str(args.mb), str(args.repeats), str(out), timeout=900)
            figures = json.loads(out.read_text())
        finally:
            hosts.close()
    report(figures, args)


def report(figures: dict, args) -> None:
    print(f"{args.hosts} simulated hosts x 1 rank; {args.mb} MiB state sharded over the ranks, "
          f"{args.repeats} repeats (alternating order); host {WIPED + 1}'s node tiers wiped before each restore")
    for mode in ("parity", "copies"):
        print(f"  {mode}: {'; '.join(figures[mode]['fetched']) or 'nothing fetched'}")
    for what, label in (("restore_s", "restore"), ("stall_s", "save blocks"), ("wait_s", "wait() after")):
        for mode in MODES:
            values = figures[mode][what]
            print(f"  {label:12} {mode:7} median {statistics.median(values) * 1000:8.1f} ms  "
                  f"(range {min(values) * 1000:.1f}-{max(values) * 1000:.1f})")
        for mode, other in (("parity", "shared"), ("parity", "copies")):
            ratios = [a / b for a, b in zip(figures[mode][what], figures[other][what])]
            print(f"  {label:12} {mode}/{other}: median {statistics.median(ratios):.2f}x "
                  f"(range {min(ratios):.2f}-{max(ratios):.2f})")
    stored = figures["bytes"]
    print(f"  stored beside the nodes' own {stored['data'] / 2**20:.1f} MiB: parity {stored['parity'] / 2**20:.1f} MiB "
          f"({stored['parity'] / stored['data']:.3f}), copies {stored['copies'] / 2**20:.1f} MiB "
          f"({stored['copies'] / stored['data']:.3f})")


if __name__ == "__main__":
    main()
