"""Where a node-scoped checkpoint's chunks are (spec 9.8, format 1.10).

A repository whose URL names each node's own storage (a node-local tier) holds, on each node, the
chunks of the boxes that node's ranks hold; the manifest's ``placement`` says which chunk rows each
node holds, so that a reader on one node knows which chunks must be there and where the others are.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass

from ckptfmt.errors import ManifestError, quoted

#: The only scope a placement describes (a job-scoped repository has none).
NODE_SCOPE = "node"


@dataclass(frozen=True)
class NodeChunks:
    """One node: its host name, the ranks that ran on it, and the chunk table rows it holds (sorted)."""

    host: str
    ranks: tuple[int, ...]
    rows: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    """The nodes of a node-scoped checkpoint and the chunks each holds."""

    nodes: tuple[NodeChunks, ...]

    def to_record(self) -> dict:
        return {"scope": NODE_SCOPE,
                "nodes": [{"host": node.host, "ranks": list(node.ranks),
                           "chunks": struct.pack(f"<{len(node.rows)}I", *node.rows)} for node in self.nodes]}

    @classmethod
    def from_record(cls, value: object, chunk_count: int) -> Placement:
        """Parse and check a manifest's ``placement`` against its chunk table's size."""
        if not isinstance(value, dict) or value.get("scope") != NODE_SCOPE or not isinstance(value.get("nodes"), list):
            raise ManifestError(f"placement must be a map with scope 'node' and a list of nodes, "
                                f"found {quoted(value)}")
        nodes: list[NodeChunks] = []
        for index, node in enumerate(value["nodes"]):
            what = f"placement.nodes[{index}]"
            if not isinstance(node, dict):
                raise ManifestError(f"{what} is not a map")
            host, ranks, chunks = node.get("host"), node.get("ranks"), node.get("chunks")
            if not isinstance(host, str) or not host:
                raise ManifestError(f"{what}.host must be a non-empty string, found {quoted(host)}")
            if not isinstance(ranks, list) or not ranks or not all(type(r) is int and r >= 0 for r in ranks):
                raise ManifestError(f"{what}.ranks must be a non-empty list of ranks, found {quoted(ranks)}")
            if nodes and min(ranks) <= min(nodes[-1].ranks):
                raise ManifestError(f"{what} (lowest rank {min(ranks)}) comes after a node whose lowest rank is "
                                    f"{min(nodes[-1].ranks)}: nodes are listed in the order of their lowest rank")
            if not isinstance(chunks, bytes) or len(chunks) % 4 or len(chunks) > 4 * chunk_count:
                raise ManifestError(f"{what}.chunks must be at most {chunk_count} little-endian uint32 rows")
            rows = struct.unpack(f"<{len(chunks) // 4}I", chunks)
            if rows and (rows[-1] >= chunk_count or any(b <= a for a, b in zip(rows, rows[1:]))):
                raise ManifestError(f"{what}.chunks must be increasing rows of the chunk table "
                                    f"(it has {chunk_count})")
            nodes.append(NodeChunks(host, tuple(ranks), rows))
        if len({node.host for node in nodes}) != len(nodes):
            raise ManifestError("placement names a host twice")
        return cls(tuple(nodes))

    def node(self, host: str) -> NodeChunks | None:
        """The node of ``host``, if it is one of the checkpoint's."""
        return next((node for node in self.nodes if node.host == host), None)

    def holders(self, row: int) -> list[str]:
        """The hosts that hold chunk row ``row``."""
        return [node.host for node in self.nodes if _has(node.rows, row)]


def _has(rows: tuple[int, ...], row: int) -> bool:
    at = bisect.bisect_left(rows, row)
    return at < len(rows) and rows[at] == row
