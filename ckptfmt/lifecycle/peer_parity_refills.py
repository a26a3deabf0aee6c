"""Rebuilding a wiped node's rows from the parity across nodes (spec 9.8; ``peer_parity``), at a restore.

The leaders pool what each node keeps: its own rows, and the parity pieces its record lists
(``ParityHeld``). A node whose rows are held nowhere is rebuilt when every stripe it gave a piece to
still has K pieces on the other nodes (``plan``): for each such round, the first K known pieces in the
code's order (the data pieces first: they need no reading of parity) travel to it, it rebuilds its
piece (spec 5.6), and its stream, so rebuilt, is cut into its chunks, each checked against its name
before it is written. ``peer_refills`` brings the manifest and commit record and commits.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError, CheckpointWarning
from ckptfmt.format import erasure
from ckptfmt.format.hashing import check_chunk
from ckptfmt.format.manifest import Chunk, Manifest
from ckptfmt.format.node_parity import (
    MAX_RECORD_BYTES,
    NodeParityRecord,
    NodeStripes,
    Round,
    piece_key,
    record_key,
)
from ckptfmt.lifecycle.peers import NodePeers, NodeStream, as_tensor, write_checked
from ckptfmt.repository.repository import Repository


@dataclass(frozen=True)
class ParityHeld:
    """The parity one node keeps of a checkpoint: the stripes' shape (its nodes' hosts in placement order,
    their stream sizes, M, the piece length) and the (round, place) of each piece it holds."""

    hosts: tuple[str, ...]
    stripes: NodeStripes
    pieces: frozenset[tuple[int, int]]


def held_parity(repo: Repository, name: str, host: str, manifest_hash: str, manifest: Manifest) -> ParityHeld | None:
    """The parity node ``host`` keeps here of checkpoint ``name`` (its ``manifest``, hashing to
    ``manifest_hash``), from its record, which must be of that manifest and fit its stripes; None where
    there is none or it does not (a damaged record keeps nothing)."""
    key = record_key(name, host)
    where = repo.storage.describe(key)
    try:
        record = repo.storage.read_checked(key, max_size=MAX_RECORD_BYTES,
                                           check=functools.partial(NodeParityRecord.from_bytes, where=where))
        if record.manifest_hash != manifest_hash or record.name != name or record.holder != host:
            return None
        stripes = record.check_layout(manifest)
    except CheckpointNotFoundError:
        return None
    except CheckpointError as exc:
        warnings.warn(f"node parity not counted: {exc}", CheckpointWarning, stacklevel=2)
        return None
    assert manifest.placement is not None  # check_layout refuses a manifest without one
    hosts = tuple(node.host for node in manifest.placement.nodes)
    return ParityHeld(hosts, stripes, frozenset((p.index, p.place) for p in record.pieces))


@dataclass(frozen=True)
class Step:
    """One round to rebuild: the lost nodes that gave it a piece, and the K known pieces sent to each, as
    (the code's index: data 0..K-1, parity K+j; the node holding it; its length)."""

    stripe: Round
    receivers: tuple[int, ...]
    sources: tuple[tuple[int, int, int], ...]


def plan(parity: Mapping[int, ParityHeld], intact: set[int], lost: set[int]) -> list[Step]:
    """The rounds that rebuild every piece of the ``lost`` nodes (placement indices), from the data of the
    ``intact`` nodes and the parity ``parity`` says each node keeps; CheckpointError naming the first
    round with fewer than K known pieces (the nodes lost are more than the parity survives)."""
    shape = next(iter(parity.values()))
    stripes, hosts = shape.stripes, shape.hosts
    kept = {node: held.pieces for node, held in parity.items()
            if node not in lost and held.stripes == stripes and held.hosts == hosts}
    steps = []
    for stripe in stripes.rounds():
        receivers = tuple(node for node, _, length in stripe.data if node in lost and length)
        if not receivers:
            continue
        known = [(index, node, length) for index, (node, _, length) in enumerate(stripe.data) if node in intact]
        known += [(stripes.k + j, holder, stripe.length) for j, holder in enumerate(stripe.holders)
                  if (stripe.index, j) in kept.get(holder, ())]
        if len(known) < stripes.k:
            names = ", ".join(hosts[node] for node in sorted(lost))
            raise CheckpointError(f"{names} lost: round {stripe.index} of the parity across nodes keeps "
                                  f"{len(known)} of its {stripes.n} pieces, {stripes.k} are needed (parity "
                                  f"across nodes survives {stripes.m} lost node{'s' if stripes.m > 1 else ''})")
        steps.append(Step(stripe, receivers, tuple(known[:stripes.k])))
    return steps


class StreamWriter:
    """A rebuilt stream, fed in order, cut into its rows' chunks, each checked and written."""

    def __init__(self, repo: Repository, chunks: list[Chunk], rows: tuple[int, ...]):
        self.repo, self.chunks, self.rows = repo, chunks, rows
        self.buffer = bytearray()
        self.position = 0
        self.written: list[tuple[str, Chunk]] = []
        self.refused: list[str] = []
        self._flush()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self.buffer += data
        self._flush()

    def _flush(self) -> None:
        while self.position < len(self.rows):
            row = self.rows[self.position]
            size = self.chunks[row].stored_size
            if len(self.buffer) < size:
                return
            stored = bytes(self.buffer[:size])
            del self.buffer[:size]
            self.position += 1
            try:
                self.written.append(write_checked(self.repo, self.chunks, row, stored, "rebuilt from parity"))
            except CheckpointError as exc:
                self.refused.append(str(exc))

    def close(self) -> list[tuple[str, Chunk]]:
        """The chunks written; CheckpointError where one was refused or the stream ended short."""
        if self.refused:
            raise CheckpointError(self.refused[0])
        if self.position < len(self.rows):
            raise CheckpointError(f"the rebuilt stream ended at row {self.rows[self.position]} of {len(self.rows)}")
        return self.written


def rebuild_rows(peers: NodePeers, repo: Repository | None, name: str, manifest: Manifest | None,
                 steps: list[Step], rank: list[int], me: int) -> list[tuple[str, Chunk]]:
    """Every leader: send the pieces ``steps`` want of this node (placement index ``me``; ``rank`` maps
    placement indices to the leaders' group), and, on a lost node, rebuild its rows; the chunks written
    here. Every message is sent and taken whatever fails, so no leader is left waiting; what failed is
    raised after (CheckpointError)."""
    stripes_k = len(steps[0].sources) if steps else 0
    writer = None
    if repo is not None and manifest is not None and any(me in step.receivers for step in steps):
        writer = StreamWriter(repo, manifest.chunks, _rows(manifest, me))
    sending = _Pieces(repo, name, peers.host, manifest, me)
    for step in steps:
        works: list = []
        incoming: dict[int, torch.Tensor] = {}
        for receiver in step.receivers:
            for index, node, length in step.sources:
                if not length:
                    continue
                if node == me:
                    works.append(dist.isend(as_tensor(sending.piece(step.stripe, index, stripes_k)),
                                            group=peers.group, group_dst=rank[receiver]))
                elif receiver == me:
                    incoming[index] = buffer = torch.empty(length, dtype=torch.uint8)
                    works.append(dist.irecv(buffer, group=peers.group, group_src=rank[node]))
        for work in works:
            work.wait()
        if me in step.receivers and writer is not None:
            available = {index: incoming[index].numpy().data if length else b"" for index, _, length in step.sources}
            mine = next(i for i, (node, _, _) in enumerate(step.stripe.data) if node == me)
            rebuilt = erasure.rebuild(available, stripes_k, len(step.stripe.holders), step.stripe.length,
                                      stripes_k, [mine])[mine]
            writer.feed(memoryview(rebuilt)[:step.stripe.data[mine][2]])
    if sending.problems:
        raise CheckpointError(sending.problems[0])
    return writer.close() if writer is not None else []


class _Pieces:
    """The pieces this node sends: its own stream's data pieces, and the parity pieces it keeps, each
    checked against its record; zeros in place of what cannot be read (said in ``problems``: the
    receiver's checks then refuse the rows rebuilt from it)."""

    def __init__(self, repo: Repository | None, name: str, host: str, manifest: Manifest | None, me: int):
        self.repo, self.name, self.host = repo, name, host
        self.problems: list[str] = []
        self.stream = None
        self.digests: dict[tuple[int, int], str] = {}
        if repo is None or manifest is None:
            return
        self.stream = NodeStream(repo, manifest.chunks, _rows(manifest, me))
        key = record_key(name, host)
        try:
            record = NodeParityRecord.from_bytes(repo.storage.read(key, max_size=MAX_RECORD_BYTES),
                                                 repo.storage.describe(key))
            self.digests = {(p.index, p.place): p.digest for p in record.pieces}
        except CheckpointError:
            pass  # a holder without its record is planned for no parity piece

    def piece(self, stripe: Round, index: int, k: int) -> bytes | bytearray:
        length = stripe.data[index][2] if index < k else stripe.length
        try:
            if self.stream is None or self.repo is None:
                raise CheckpointError(f"{self.host} cannot read its tier")
            if index < k:
                return self.stream.read(stripe.data[index][1], length)
            key = piece_key(self.name, self.host, stripe.index, index - k)
            data = self.repo.storage.read(key, max_size=length)
            check_chunk(data, self.digests.get((stripe.index, index - k), ""), self.repo.storage.describe(key))
            return data
        except CheckpointError as exc:
            self.problems.append(f"not sent for the rebuild: {exc}")
            return bytes(length)


def _rows(manifest: Manifest, node: int) -> tuple[int, ...]:
    """The chunk rows of placement node ``node`` (by index), in order: its stream's."""
    assert manifest.placement is not None  # a checkpoint with parity across nodes is node-scoped
    return tuple(manifest.placement.nodes[node].rows)


__all__ = ["ParityHeld", "Step", "StreamWriter", "held_parity", "plan", "rebuild_rows"]
