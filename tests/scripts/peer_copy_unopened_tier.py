"""Two ranks on two "nodes" of one machine run the peer copy of a checkpoint that no node holds, rank 1's
node tier impossible to open (its path is a file): each leader takes its turn and reports no copy.

    torchrun --nproc_per_node 2 peer_copy_unopened_tier.py FOLDER OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from ckptfmt.groups.nodes import NodeLayout
from ckptfmt.groups.process_group import RankGroup
from ckptfmt.lifecycle.housekeeping import Tier
from ckptfmt.lifecycle.peer_copies import copy_to_peers
from ckptfmt.lifecycle.peers import NodePeers


def main() -> None:
    folder, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    url = folder / "tier" if rank == 0 else folder / "a-file" / "tier"  # rank 1's cannot be created
    peers = NodePeers(Tier(str(url), scope="node"), RankGroup(None, 60, "finding each node's leader"),
                      NodeLayout.of(["nodeA", "nodeB"]), 1, 60)
    problems = copy_to_peers(peers, "step-1")
    out.with_suffix(f".{rank}.json").write_text(json.dumps({"problems": problems, "broken": peers.broken}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
