"""A CheckpointManager across simulated hosts (tests/hosts/) with a node-local first tier.

    torchrun --nnodes N --node_rank I ... hosts_manager.py LOCAL SHARED STEPS [OUT]

Data-parallel training (gradients averaged every step); ``CheckpointManager(tiers=[Tier(LOCAL,
scope="node"), SHARED], keep_last=2)`` restores the newest checkpoint every rank can read, then saves
every 2 steps to each node's own disk at LOCAL, and copies to the shared folder SHARED. With OUT,
each rank writes what it restored to OUT.RANK.pt (the step, the model, and where it came from).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import ckptfmt


def ckptfmt_resumes() -> list[dict]:
    """This process's resumes not yet on record: where the restore read from."""
    from ckptfmt.metadata.resumes import pending_resumes

    return pending_resumes()


def main() -> None:
    local, shared, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    out = sys.argv[4] if len(sys.argv) > 4 else None
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = torch.Generator().manual_seed(dist.get_rank())
    with ckptfmt.CheckpointManager(tiers=[ckptfmt.Tier(local, scope="node"), shared], keep_last=2, interval=2,
                                   housekeeping="thread") as manager:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 0}
        restored = manager.restore(into=state)
        if out is not None:
            torch.save({"step": manager.restored_step, "model": {k: v.clone() for k, v in model.state_dict().items()},
                        "resumes": ckptfmt_resumes()}, f"{out}.{dist.get_rank()}.pt")
        for step in range(manager.start_step if restored is not None else 1, steps + 1):
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
