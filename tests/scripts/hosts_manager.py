"""A CheckpointManager across simulated hosts (tests/hosts/) with a node-local first tier.

    torchrun --nnodes N --node_rank I ... hosts_manager.py LOCAL SHARED STEPS [--out OUT] [--table] [--parity M]

Data-parallel training with AdamW (gradients averaged every step); ``CheckpointManager(tiers=[Tier(LOCAL,
scope="node"), SHARED], keep_last=2)`` restores the newest checkpoint every rank can read into the
model and a fresh optimizer themselves (its moments made and filled from the checkpoint), then saves
every 2 steps to each node's own disk at LOCAL, and copies to the shared folder SHARED (``none``: no
shared tier). ``--table``: the state also holds an embedding table sharded over the ranks (a DTensor,
``arange + step``), so each node holds rows no other node's ranks hold. With OUT, each rank writes
what it restored to OUT.RANK.pt (the step, the model, the optimizer's state, its rows of the table,
where it came from, and what the manager fetched from other nodes' copies). ``--parity M``: the node tier
is protected by parity across nodes (``redundancy="parity"``, ``survives=M``) instead of peer copies.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ckptfmt


def ckptfmt_resumes() -> list[dict]:
    """This process's resumes not yet on record: where the restore read from."""
    from ckptfmt.metadata.resumes import pending_resumes

    return pending_resumes()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("local")
    parser.add_argument("shared")
    parser.add_argument("steps", type=int)
    parser.add_argument("--out")
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--format-version", help="save for readers of this format version (1.10 on: node tiers)")
    parser.add_argument("--parity", type=int, help="protect the node tier by parity across nodes surviving this "
                                                   "many lost nodes (redundancy='parity') instead of peer copies")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    batches = torch.Generator().manual_seed(dist.get_rank())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rows = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    node_tier = ckptfmt.Tier(args.local, scope="node") if args.parity is None else \
        ckptfmt.Tier(args.local, scope="node", redundancy="parity", survives=args.parity)
    tiers = [node_tier, *([] if args.shared == "none" else [args.shared])]

    def state(step: int) -> dict:
        extra = {"table": distribute_tensor(rows + step, mesh, [Shard(0)])} if args.table else {}
        return {"model": model, "optimizer": optimizer, "step": step, **extra}
    with ckptfmt.CheckpointManager(tiers=tiers, keep_last=2, interval=2, housekeeping="thread",
                                   format_version=args.format_version) as manager:
        into = state(0)
        restored = manager.restore(into=into)
        if args.out is not None:
            torch.save({"step": manager.restored_step, "model": {k: v.clone() for k, v in model.state_dict().items()},
                        "optimizer": optimizer.state_dict(),
                        "table": into["table"].to_local().clone() if args.table else None,
                        "resumes": ckptfmt_resumes(), "fetched": manager.fetched_from_peers},
                       f"{args.out}.{dist.get_rank()}.pt")
        for step in range(manager.start_step if restored is not None else 1, args.steps + 1):
            model(torch.randn(8, 16, generator=batches)).square().mean().backward()
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)
            optimizer.step()
            optimizer.zero_grad()
            manager.save(step, state(step))
        manager.wait()


if __name__ == "__main__":
    main()
    dist.destroy_process_group()  # and a normal exit, as a user's job ends
