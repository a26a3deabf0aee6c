"""One job of bench/many_nodes.py, on every rank of simulated hosts (launched by it under torchrun).

    many_nodes_job.py MODE LOCAL SHARED SIZE_MB SAVES OUT

A data-parallel state of SIZE_MB (fp32, replicated on every rank), changed before each save. MODE
``node``: ``CheckpointManager(tiers=[Tier(LOCAL, scope="node"), SHARED])``; ``shared``: the shared
tier alone. Saves SAVES times (every weight changed before each), then restores the newest in a new
manager; in MODE ``node``, the last host's disk is then wiped and the job restores again (that node's
chunks refilled from its peer's copy). Rank 0 writes its stall per save and the restores' times to
OUT as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import torch
import torch.distributed as dist

import ckptfmt


def main() -> None:
    mode, local, shared, size_mb, saves, out = sys.argv[1], sys.argv[2], sys.argv[3], *map(int, sys.argv[4:6]), \
        sys.argv[6]
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same replicated state on every rank
    tensors = max(1, size_mb // 16)
    state = {f"layer{i}": torch.randn(4 * 2**20) for i in range(tensors)}  # 16 MiB each
    tiers = [ckptfmt.Tier(local, scope="node"), shared] if mode == "node" else [shared]
    stalls = []
    with ckptfmt.CheckpointManager(tiers=tiers, keep_last=2, housekeeping="thread") as manager:
        for step in range(1, saves + 1):
            for value in state.values():
                value.add_(1.0)
            dist.barrier()
            began = time.perf_counter()
            manager.save(step, state)
            stalls.append(time.perf_counter() - began)
        manager.wait()
    dist.barrier()
    restore_s = timed_restore(tiers, state)
    figures = {"stalls_s": stalls, "restore_s": restore_s}
    if mode == "node":
        if os.environ["LOCAL_RANK"] == "0" and os.environ["GROUP_RANK"] == str(int(os.environ["WORLD_SIZE"]) // int(
                os.environ["LOCAL_WORLD_SIZE"]) - 1):
            shutil.rmtree(local)  # the last node's disk, replaced
        dist.barrier()
        figures["wiped_restore_s"] = timed_restore(tiers, state)
    if dist.get_rank() == 0:
        with open(out, "w") as file:
            json.dump(figures, file)
    dist.destroy_process_group()


def timed_restore(tiers: list, state: dict) -> float:
    """Seconds for a new manager's ``restore`` of the newest checkpoint into ``state``, every rank done."""
    with ckptfmt.CheckpointManager(tiers=tiers, keep_last=2, housekeeping="thread") as manager:
        began = time.perf_counter()
        manager.restore(into=state)
        dist.barrier()
        return time.perf_counter() - began


if __name__ == "__main__":
    main()
