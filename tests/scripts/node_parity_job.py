"""N ranks as N "nodes" of one machine, each node tier in its own process's memory, protected by parity
across the nodes (``Tier(..., redundancy="parity")``); then nodes' tiers wiped and the job restored.

    torchrun --nproc_per_node N node_parity_job.py SHARED OUT M

Each rank says it runs on host ``node<A + rank>`` (so the job has N nodes of one rank each) and keeps its
node tier at ``memory://run`` (each process's memory is its own: a node's own disk). The state is a
model, its AdamW moments and a table sharded over the ranks (each node holds rows no other holds). The
manager saves at steps 2, 4 and 6, protected by parity M, and copies to SHARED. Then:

1. rank 1's tier is wiped, and ``restore`` rebuilds its rows of step 6 from the others' parity (and,
   in the background, the parity it held);
2. ranks 1 and 2's tiers are wiped, and ``restore`` (more nodes lost than M) says why the nodes cannot
   rebuild step 6 and restores it from SHARED.

Each rank writes OUT.RANK.json: per restore, the step, the repository it came from, what was fetched,
the warnings, and whether every tensor equals what was saved; its tier's parity record; whether
``verify`` on its node passed before the wipes and, on the nodes never wiped, what it says at the end
once a parity piece is damaged and another deleted.
"""

from __future__ import annotations

import json
import socket
import sys
import warnings

import fsspec
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ckptfmt
from ckptfmt.format.node_parity import NodeParityRecord, piece_key, record_key


def main() -> None:
    shared, out, m = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    host = f"node{chr(ord('A') + rank)}"
    socket.gethostname = lambda: host  # this process is node ``host``
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    mesh = init_device_mesh("cpu", (world,))
    rows = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)

    def state(step: int) -> dict:
        return {"model": model, "optimizer": optimizer, "step": step,
                "table": distribute_tensor(rows * step, mesh, [Shard(0)])}

    tiers = [ckptfmt.Tier("memory://run", scope="node", redundancy="parity", survives=m), shared]
    report: dict = {"restores": []}
    with ckptfmt.CheckpointManager(tiers=tiers, keep_last=2, interval=2, housekeeping="thread") as manager:
        for step in range(1, 7):
            model(torch.randn(4, 32)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            manager.save(step, state(step))
        manager.wait()
        saved = {key: value.clone() for key, value in model.state_dict().items()}
        repo = ckptfmt.Repository.open("memory://run")
        name = repo.names()[-1]
        record = NodeParityRecord.from_bytes(repo.storage.read(record_key(name, host), max_size=1 << 20), host)
        report["parity"] = {"name": name, "pieces": len(record.pieces), "bytes": record.stored_bytes, "m": record.m,
                            "data": sum(c.stored_size for row, c in enumerate(repo.manifest(name).chunks)
                                        if row in repo.manifest(name).placement.node(host).rows)}
        report["verified"] = ckptfmt.verify("memory://run", node=host).ok  # its parity pieces checked too
        for wiped in ([1], [1, 2]):
            dist.barrier()
            if rank in wiped:
                fsspec.filesystem("memory").rm("/run", recursive=True)
            dist.barrier()
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.zero_()
            into = state(0)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                manager.restore(into=into)
            expected = rows[64 // world * rank:64 // world * (rank + 1)] * 6
            report["restores"].append({
                "step": manager.restored_step, "from": manager.restored_url, "fetched": manager.fetched_from_peers,
                "warnings": [str(w.message) for w in caught],
                "equal": torch.equal(into["table"].to_local(), expected)
                and all(torch.equal(value, saved[key]) for key, value in model.state_dict().items())})
            if wiped == [1]:  # the rebuilt node's parity is computed again, in the background
                manager.wait()
                again = ckptfmt.Repository.open("memory://run")
                report["parity_again"] = again.storage.exists(record_key(name, host)) and ckptfmt.verify(
                    "memory://run", node=host).ok
        if rank in (0, 3):  # the nodes never wiped: their tiers hold what they saved
            report["verify"] = damage_and_verify(repo, name, host, record)
    with open(f"{out}.{rank}.json", "w") as file:
        json.dump(report, file)


def damage_and_verify(repo: ckptfmt.Repository, name: str, host: str, record: NodeParityRecord) -> list:
    """One parity piece this node keeps damaged and another deleted: the problems ``verify`` on this node
    finds then, as (kind, key, message)."""
    first, last = record.pieces[0], record.pieces[-1]
    damaged, deleted = (piece_key(name, host, p.index, p.place) for p in (first, last))
    repo.storage.write(damaged, b"\x01" + repo.storage.read(damaged, max_size=first.length)[1:])
    repo.storage.delete(deleted)
    return [(p.kind, p.key, p.message) for p in ckptfmt.verify("memory://run", node=host).problems]


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
