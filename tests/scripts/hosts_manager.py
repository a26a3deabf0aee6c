"""A CheckpointManager across simulated hosts (tests/hosts/) with a node-local first tier.

    torchrun --nnodes N --node_rank I ... hosts_manager.py LOCAL SHARED STEPS

Data-parallel training (gradients averaged every step); ``CheckpointManager(tiers=[Tier(LOCAL,
scope="node"), SHARED], keep_last=2)`` saves every 2 steps to each node's own disk at LOCAL, and
copies to the shared folder SHARED. Rank 0 prints the manager's saved steps.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import ckptfmt


def main() -> None:
    local, shared, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = torch.Generator().manual_seed(dist.get_rank())
    with ckptfmt.CheckpointManager(tiers=[ckptfmt.Tier(local, scope="node"), shared], keep_last=2, interval=2,
                                   housekeeping="thread") as manager:
        for step in range(1, steps + 1):
            model(torch.randn(8, 16, generator=batches)).square().mean().backward()
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)
            optimizer.step()
            optimizer.zero_grad()
            manager.save(step, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step})
        manager.wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
