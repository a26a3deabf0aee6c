"""What the peer copies of a node-scoped tier share (docs/design/many-nodes.md; spec 9.8): this rank's place
among the nodes' leaders, their gloo group, and chunks moved over it.

Copies to peers (``peer_copies``), drains to the next tier (``peer_drains``) and refills after a wiped
disk (``peer_refills``) all run between the same leaders, one failure of their group stops the copies
and drains that follow, and copies and refills cut the same messages from a manifest: so the group,
that state and the wire format live here once.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch
import torch.distributed as dist

from ckptfmt.errors import CheckpointError
from ckptfmt.format import codecs
from ckptfmt.format.chunk_table import stored_key
from ckptfmt.format.hashing import check_chunk
from ckptfmt.format.manifest import Chunk, optional_fields_except
from ckptfmt.format.version import FORMAT_VERSION
from ckptfmt.groups.nodes import NodeLayout
from ckptfmt.groups.process_group import RankGroup, peer_group
from ckptfmt.lifecycle.housekeeping import Tier
from ckptfmt.repository.chunk_reads import read_chunk
from ckptfmt.repository.repository import Repository

#: Chunk bytes sent in one message at most (a larger chunk goes alone): what a leader holds at a time.
BATCH_BYTES = 64 << 20
#: The manifest's fields peer copies do without (the chunk table and the placement are all they read).
SKIPPED = optional_fields_except("placement")


class NodePeers:
    """One rank's place among the leaders of ``tier`` (node-scoped), from the job's ``nodes`` over ``ranks``:
    made by every rank together; only the nodes' leaders join the leaders' ``group`` and move chunks."""

    def __init__(self, tier: Tier, ranks: RankGroup, nodes: NodeLayout, survives: int, timeout_s: float,
                 format_version: tuple[int, int] = FORMAT_VERSION):
        self.tier = tier
        #: The version a node tier this creates is written for (its saves' ``format_version=``).
        self.format_version = format_version
        self.ranks = ranks
        #: The job's nodes (``ranks``' positions are the group's ranks); this rank's node, by index and host.
        self.nodes = nodes
        self.index = nodes.node_of[ranks.rank]
        self.host = nodes.hosts[self.index]
        self.is_leader = nodes.leaders[self.index] == ranks.rank
        #: How many lost nodes the tier survives (peer copies, or parity pieces a round), at most the others.
        self.survives = max(0, min(survives, len(nodes.hosts) - 1))
        self.group = None
        if self.is_leader and len(nodes.hosts) > 1:
            leaders = [ranks.global_ranks[leader] for leader in nodes.leaders]
            self.group = peer_group(leaders, timeout_s, "peer copies")
        #: Why the leaders' group failed (None: it has not): the copies and drains after it are not tried.
        self.broken: str | None = None

    def open_tier(self) -> Repository:
        """This node's tier, made where it does not exist yet."""
        return Repository.open(self.tier.url, self.tier.storage_options, create=True,
                               format_version=self.format_version)

    def all_gather(self, value) -> list:
        """Every leader's ``value``, in node order."""
        out = [None] * len(self.nodes.hosts)
        dist.all_gather_object(out, value, group=self.group)
        return out

    def fail(self, what: str, exc: RuntimeError) -> str:
        """The leaders' group failed ``what`` (gloo: a peer died or timed out): said, and kept in ``broken``."""
        self.broken = f"the peers' group failed {what} ({' '.join(str(exc).split())[:300]})"
        return self.broken


def batches(chunks: list[Chunk], rows: list[int]) -> list[list[int]]:
    """``rows`` cut into messages of at most ``BATCH_BYTES`` (a larger chunk alone); empty chunks travel
    in whichever message they fall in, as no bytes."""
    cut: list[list[int]] = []
    size = BATCH_BYTES
    for row in rows:
        stored = chunks[row].stored_size
        if not cut or size + stored > BATCH_BYTES:
            cut.append([])
            size = 0
        cut[-1].append(row)
        size += stored
    return cut


def pack(repo: Repository, chunks: list[Chunk], rows: list[int], problems: list[str]) -> torch.Tensor:
    """The rows' chunks as stored, end to end, each checked against its name here: a damaged or missing
    one is sent as zeros (the receiver's check refuses it; the message keeps its expected size) and
    said in ``problems``: damage is never copied."""
    payload = torch.zeros(sum(chunks[row].stored_size for row in rows), dtype=torch.uint8)
    view, at = payload.numpy(), 0
    for row in rows:
        chunk = chunks[row]
        try:
            stored = read_chunk(repo.storage, stored_key(chunks, chunk), chunk).stored
            view[at:at + len(stored)] = np.frombuffer(stored, dtype=np.uint8)
        except CheckpointError as exc:
            problems.append(f"not sent to the peer: {exc}")
        at += chunk.stored_size
    return payload


def unpack(repo: Repository, chunks: list[Chunk], rows: list[int], buffer: torch.Tensor) -> list[tuple[str, Chunk]]:
    """Write the rows' chunks from ``buffer``, each checked against its name first; their keys."""
    data, at, written = buffer.numpy(), 0, []
    for row in rows:
        chunk = chunks[row]
        written.append(write_checked(repo, chunks, row, data[at:at + chunk.stored_size].tobytes(), "as received"))
        at += chunk.stored_size
    return written


def write_checked(repo: Repository, chunks: list[Chunk], row: int, stored: bytes, how: str) -> tuple[str, Chunk]:
    """Write row ``row``'s chunk from its ``stored`` bytes (got ``how``), checked against its name first."""
    chunk = chunks[row]
    key = stored_key(chunks, chunk)
    where = f"{repo.storage.describe(key)} ({how})"
    check_chunk(codecs.decode(chunk.codec, stored, chunk.size, where, None), chunk.hash, where)
    repo.storage.write(key, stored, durable=False)
    return key, chunk


def as_tensor(data: bytes | bytearray | memoryview) -> torch.Tensor:
    """``data`` as a uint8 tensor gloo can send (a copy: gloo wants memory it may write)."""
    out = torch.empty(len(data), dtype=torch.uint8)
    out.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    return out


class NodeStream:
    """A node's stream (spec 9.8, parity across nodes): the stored bytes of its ``rows``, end to end, read
    by ranges; each chunk is read once at a time and checked against its name."""

    def __init__(self, repo: Repository, chunks: list[Chunk], rows: tuple[int, ...]):
        self.repo, self.chunks, self.rows = repo, chunks, rows
        self.starts = [0]
        for row in rows:
            self.starts.append(self.starts[-1] + chunks[row].stored_size)
        self._cached: tuple[int, bytes] | None = None

    def read(self, offset: int, length: int) -> bytearray:
        """Bytes [offset, offset + length) of the stream (CheckpointError: a chunk of them is damaged)."""
        out = bytearray()
        position = bisect.bisect_right(self.starts, offset) - 1
        while len(out) < length and position < len(self.rows):
            stored = self._chunk(position)
            begin = offset + len(out) - self.starts[position]
            out += stored[begin:begin + length - len(out)]
            position += 1
        return out

    def _chunk(self, position: int) -> bytes:
        if self._cached is None or self._cached[0] != position:
            chunk = self.chunks[self.rows[position]]
            self._cached = (position, read_chunk(self.repo.storage, stored_key(self.chunks, chunk), chunk).stored)
        return self._cached[1]
