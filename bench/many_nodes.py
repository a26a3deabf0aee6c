"""Node-local tiers against the shared tier alone, on hosts simulated with network namespaces (issue 30).

    python bench/many_nodes.py [--hosts 2] [--ranks 2] [--mb 256] [--saves 4] [--repeats 5]

Runs bench/many_nodes_job.py on ``--hosts`` simulated hosts of ``--ranks`` ranks each
(tests/support/hosts.py: each host its own network namespace, hostname and local folder; needs root
and iproute2), once with ``CheckpointManager(tiers=[Tier(local, scope="node"), shared])`` and once
with the shared tier alone, in alternating order, ``--repeats`` times. Prints, per mode, the median
stall per save (how long ``manager.save`` holds rank 0's loop) and the time to restore the newest
checkpoint, with the median and range of the per-repeat ratios node/shared; and, with node-local
tiers, the restore after the last host's disk is wiped (its chunks refilled from its peer's copy),
against the shared tier alone's restore.

What the simulation cannot show: every host's "local disk" and the "shared" folder are folders of
this one machine, on one disk, so the node-local tier does not add the bandwidth of one NVMe per
node, and the shared folder is not slowed by many nodes writing at once. Node-local tiers write a
replicated state once per node (here twice), which one disk pays for in full.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.hosts import SimulatedHosts  # noqa: E402  (the test suite's simulated hosts)

JOB = Path(__file__).with_name("many_nodes_job.py")


def run(hosts: SimulatedHosts, mode: str, args, folder: Path) -> dict:
    local, shared = hosts.local / "run", hosts.shared / "run"
    for path in [shared, *(host.disk / "run" for host in hosts.hosts)]:
        shutil.rmtree(path, ignore_errors=True)
    out = folder / f"{mode}.json"
    hosts.torchrun(str(JOB), args.ranks, mode, str(local), str(shared), str(args.mb), str(args.saves), str(out),
                   timeout=600)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        hosts = SimulatedHosts(args.hosts, Path(folder) / "hosts").start()
        try:
            figures: dict[str, dict[str, list[float]]] = {"node": {"stall": [], "restore": [], "wiped": []},
                                                          "shared": {"stall": [], "restore": []}}
            for repeat in range(args.repeats):
                for mode in (("node", "shared") if repeat % 2 == 0 else ("shared", "node")):
                    found = run(hosts, mode, args, Path(folder))
                    figures[mode]["stall"].append(statistics.median(found["stalls_s"]))
                    figures[mode]["restore"].append(found["restore_s"])
                    if mode == "node":
                        figures[mode]["wiped"].append(found["wiped_restore_s"])
        finally:
            hosts.close()
    print(f"{args.hosts} hosts x {args.ranks} ranks, {args.mb} MiB replicated state, {args.saves} saves, "
          f"{args.repeats} repeats (alternating order)")
    for what in ("stall", "restore"):
        for mode in ("node", "shared"):
            values = figures[mode][what]
            print(f"  {what:8} {mode:7} median {statistics.median(values) * 1000:8.1f} ms  "
                  f"(range {min(values) * 1000:.1f}-{max(values) * 1000:.1f})")
        ratios = [n / s for n, s in zip(figures["node"][what], figures["shared"][what])]
        print(f"  {what:8} node/shared: median {statistics.median(ratios):.2f}x "
              f"(range {min(ratios):.2f}-{max(ratios):.2f})")
    wiped = figures["node"]["wiped"]
    ratios = [w / s for w, s in zip(wiped, figures["shared"]["restore"])]
    print(f"  restore with the last host's disk wiped (node tiers): median {statistics.median(wiped) * 1000:.1f} ms "
          f"(range {min(wiped) * 1000:.1f}-{max(wiped) * 1000:.1f}); / the shared tier alone's restore: median "
          f"{statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
