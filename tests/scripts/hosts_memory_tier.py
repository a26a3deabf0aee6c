"""A CheckpointManager across simulated hosts (tests/hosts/test_memory_tier.py) whose first tier is each
node's memory (a tmpfs: tests/support/hosts.py's ``SimulatedHosts.memory``).

    torchrun --nnodes N --node_rank I ... hosts_memory_tier.py MEMORY SHARED STEPS RECORD
        [--out OUT] [--die-after STEP --die-rank RANK]

hosts_manager.py's job (data-parallel training with AdamW, an embedding table sharded over the ranks,
``arange + step``), with ``CheckpointManager(tiers=[Tier(MEMORY, scope="node", survives=1), SHARED],
keep_last=2)``: restores the newest checkpoint every rank can read, then saves every 2 steps. At each
save, each rank writes what it saved (the model, the optimizer's state, its rows of the table) to
RECORD/STEP.RANK.pt, for the test to compare a restore with bit for bit. With OUT, each rank writes
what it restored to OUT.RANK.pt (the step, the state, where it came from, what the manager fetched
from other nodes' copies). ``--die-after STEP``: rank RANK is killed (SIGKILL, sent to itself) as soon
as its save of STEP has returned, while the manager's copies to the peers and the shared tier may
still run: the other ranks fail at their next collective and the launch fails.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ckptfmt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("memory")
    parser.add_argument("shared")
    parser.add_argument("steps", type=int)
    parser.add_argument("record")
    parser.add_argument("--out")
    parser.add_argument("--die-after", type=int)
    parser.add_argument("--die-rank", type=int, default=0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    batches = torch.Generator().manual_seed(rank)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rows = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    tiers = [ckptfmt.Tier(args.memory, scope="node", survives=1), args.shared]

    def state(step: int) -> dict:
        return {"model": model, "optimizer": optimizer, "step": step,
                "table": distribute_tensor(rows + step, mesh, [Shard(0)])}

    def snapshot(table: torch.Tensor) -> dict:
        return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optimizer": optimizer.state_dict(),
                "table": table.to_local().clone()}

    with ckptfmt.CheckpointManager(tiers=tiers, keep_last=2, interval=2, housekeeping="thread") as manager:
        into = state(0)
        restored = manager.restore(into=into)
        if args.out is not None:
            from ckptfmt.metadata.resumes import pending_resumes

            torch.save({"step": manager.restored_step, **snapshot(into["table"]), "resumes": pending_resumes(),
                        "fetched": manager.fetched_from_peers}, f"{args.out}.{rank}.pt")
        for step in range(manager.start_step if restored is not None else 1, args.steps + 1):
            model(torch.randn(8, 16, generator=batches)).square().mean().backward()
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)
            optimizer.step()
            optimizer.zero_grad()
            saving = state(step)
            if manager.save(step, saving):
                torch.save(snapshot(saving["table"]), Path(args.record) / f"{step}.{rank}.pt")
                if step == args.die_after and rank == args.die_rank:
                    os.kill(os.getpid(), signal.SIGKILL)
        manager.wait()


if __name__ == "__main__":
    main()
    dist.destroy_process_group()  # and a normal exit, as a user's job ends
