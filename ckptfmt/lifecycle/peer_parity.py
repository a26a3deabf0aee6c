"""Parity across the nodes of a node-scoped tier (``Tier(..., redundancy="parity")``; spec 9.8): after each save.

Instead of full copies on peers, each node's stream (the stored bytes of its rows) is dealt into stripes
with the other nodes' (``format.node_parity``): in each round one node, the round's first holder,
receives the K data pieces from the other nodes' leaders, computes the M parity pieces (spec 5.6's code,
zfec), keeps the first and sends the others to the round's other holders. Receiving K pieces and encoding
once costs what one copy of the data over the network costs; each node stores about M/K of a node's
data. Rounds go a period (N rounds) at a time: in a period each node is the first holder once, and every
message of it is posted at once.

Each holder writes its pieces, reads them back and checks them, and writes its record
(``NAME/node-parity-<host>.msgpack``) only once every leader has: a record says its checkpoint's
stripes are whole. Refilling a wiped node from this parity is ``peer_parity_refills``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from ckptfmt.errors import CheckpointError
from ckptfmt.format import erasure
from ckptfmt.format.hashing import check_chunk, chunk_hash
from ckptfmt.format.manifest import Manifest
from ckptfmt.format.node_parity import (
    MAX_NODE_PIECES,
    HeldPiece,
    NodeParityRecord,
    NodeStripes,
    Round,
    node_sizes,
    piece_key,
    record_key,
)
from ckptfmt.lifecycle.peers import SKIPPED, NodePeers, NodeStream, as_tensor
from ckptfmt.repository.repository import Repository

#: A first holder receives K pieces a round: a piece is this over K, so that a round's pieces stay
#: within it (16 MiB at most, 64 bytes at least).
ROUND_BYTES = 256 << 20
#: Pieces of the longest stream at least K times this many: enough rounds that parity spreads evenly.
MIN_PERIODS = 8
_ALIGN = 64


def piece_size(sizes: tuple[int, ...], m: int) -> int:
    """The piece length for streams of ``sizes`` under parity ``m``: a multiple of 64 bytes."""
    k = len(sizes) - m
    largest = max(sizes, default=0)
    wanted = -(-largest // (k * MIN_PERIODS))
    upper = max(_ALIGN, min(16 << 20, ROUND_BYTES // k) // _ALIGN * _ALIGN)
    size = min(max(_ALIGN, -(-wanted // _ALIGN) * _ALIGN), upper)
    return max(size, -(-largest // MAX_NODE_PIECES))


class Layout:
    """A checkpoint's stripes across the job's nodes: placement index <-> the leaders' group rank."""

    def __init__(self, peers: NodePeers, manifest: Manifest, m: int):
        placement = manifest.placement
        hosts = [node.host for node in placement.nodes] if placement is not None else []
        if sorted(hosts) != sorted(peers.nodes.hosts):
            raise CheckpointError(f"its nodes ({', '.join(hosts)}) are not the job's ({', '.join(peers.nodes.hosts)})")
        assert placement is not None  # the hosts above match the job's: a placement was there
        self.hosts = hosts
        self.rank = [peers.nodes.hosts.index(host) for host in hosts]  # placement index -> group rank
        self.me = hosts.index(peers.host)
        sizes = node_sizes(manifest)
        self.stripes = NodeStripes(sizes, m, piece_size(sizes, m))
        self.stream_rows = tuple(placement.nodes[self.me].rows)


def protect_across_nodes(peers: NodePeers, name: str,
                         yield_to: Callable[[], object] | None = None) -> list[str]:
    """Parity across the nodes for checkpoint ``name`` (every leader calls this for every checkpoint, in
    the same order); what failed, in words. ``yield_to`` is called before each period and may block."""
    if peers.group is None or not peers.survives:
        return []
    if peers.broken is not None:
        return [f"parity across nodes for {name} skipped: {peers.broken}"]
    repo: Repository | None = None
    manifest: Manifest | None = None
    digest: str | None = None
    try:
        repo = peers.open_tier()
        record = repo.commit(name)
        manifest, digest = repo.manifest(name, record, skip=SKIPPED), record.manifest_hash
    except CheckpointError:
        pass  # not committed on this node: no node computes parity for it
    try:
        digests = peers.all_gather(digest)
        if digest is None or any(other != digest for other in digests):
            missing = [peers.nodes.hosts[i] for i, other in enumerate(digests) if other != digest]
            return [] if digest is None else [f"no parity across nodes for {name}: not committed as here on "
                                              f"{', '.join(missing)}"]
        assert repo is not None and manifest is not None
        try:
            layout = Layout(peers, manifest, peers.survives)
        except (CheckpointError, ValueError) as exc:
            return [f"no parity across nodes for {name}: {exc}"]
        return _encode(peers, repo, name, digest, manifest, layout, yield_to)
    except RuntimeError as exc:  # gloo: a peer died or timed out; the next checkpoints are not tried
        return [peers.fail(f"at {name}", exc)]


def _encode(peers: NodePeers, repo: Repository, name: str, digest: str, manifest: Manifest, layout: Layout,
            yield_to: Callable[[], object] | None) -> list[str]:
    """Every period's exchange, then this holder's pieces checked and, once every leader's are, recorded."""
    stream = NodeStream(repo, manifest.chunks, layout.stream_rows)
    problems: list[str] = []
    held: list[HeldPiece] = []
    stripes = layout.stripes
    for period in _periods(stripes.rounds(), stripes.n):
        if yield_to is not None:
            yield_to()
        held += _exchange(peers, repo, name, layout, stream, period, problems)
    if not problems:
        try:
            _check_written(repo, name, peers.host, held)
        except CheckpointError as exc:
            problems.append(f"parity across nodes for {name} not kept on {peers.host}: {exc}")
    failed = [host for host, ok in zip(peers.nodes.hosts, peers.all_gather(not problems)) if not ok]
    if failed:  # a stripe computed from a damaged piece, or parity not kept: no record anywhere
        repo.storage.delete_many([piece_key(name, peers.host, p.index, p.place) for p in held])
        return problems or [f"parity across nodes for {name} not recorded: it failed on {', '.join(failed)}"]
    record = NodeParityRecord(name, digest, peers.host, stripes.m, stripes.piece, tuple(held), repo.format_version)
    repo.storage.write(record_key(name, peers.host), record.to_bytes())
    return []


def _periods(rounds: Iterable[Round], n: int) -> Iterable[list[Round]]:
    """The rounds N at a time: in each, every node is the first holder of one round."""
    rounds = iter(rounds)
    while period := list(itertools.islice(rounds, n)):
        yield period


def _exchange(peers: NodePeers, repo: Repository, name: str, layout: Layout, stream: NodeStream,
              period: list[Round], problems: list[str]) -> list[HeldPiece]:
    """One period: this node's data pieces to their rounds' first holders; as a first holder, its round's
    K pieces in, the parity out to the other holders; the parity pieces this node holds, written."""
    me, rank, m, k = layout.me, layout.rank, layout.stripes.m, layout.stripes.k
    works, incoming = [], {}
    for stripe in period:
        if not stripe.length:
            continue
        for node, offset, length in stripe.data:
            if node == me and length:
                works.append(dist.isend(as_tensor(_read(stream, offset, length, name, problems)),
                                        group=peers.group, group_dst=rank[stripe.holders[0]]))
            elif stripe.holders[0] == me and length:
                incoming[stripe.index, node] = buffer = torch.empty(length, dtype=torch.uint8)
                works.append(dist.irecv(buffer, group=peers.group, group_src=rank[node]))
    _wait(works)
    kept: dict[tuple[int, int], bytes] = {}
    for stripe in period:
        if stripe.length and stripe.holders[0] == me:
            pieces = [incoming[stripe.index, node].numpy().data if length else b""
                      for node, _, length in stripe.data]
            parity = erasure.encode(pieces, k, m, stripe.length)
            kept[stripe.index, 0] = bytes(parity[0])
            works += [dist.isend(as_tensor(parity[j]), group=peers.group, group_dst=rank[stripe.holders[j]])
                      for j in range(1, m)]
        elif stripe.length and me in stripe.holders:
            place = stripe.holders.index(me)
            incoming[stripe.index, -1] = buffer = torch.empty(stripe.length, dtype=torch.uint8)
            works.append(dist.irecv(buffer, group=peers.group, group_src=rank[stripe.holders[0]]))
            kept[stripe.index, place] = b""  # filled once received
    _wait(works)
    held = []
    for (index, place), data in sorted(kept.items()):
        data = data if place == 0 else incoming[index, -1].numpy().tobytes()
        repo.storage.write(piece_key(name, peers.host, index, place), data, durable=False)
        held.append(HeldPiece(index, place, len(data), chunk_hash(data)))
    return held


def _read(stream: NodeStream, offset: int, length: int, name: str, problems: list[str]) -> bytes | bytearray:
    """A data piece of this node's stream; zeros where a chunk of it is damaged (said in ``problems``: no
    node records parity computed from it)."""
    try:
        return stream.read(offset, length)
    except CheckpointError as exc:
        problems.append(f"parity across nodes for {name} not computed: {exc}")
        return bytes(length)


def _wait(works: list) -> None:
    for work in works:
        work.wait()
    works.clear()


def _check_written(repo: Repository, name: str, host: str, held: list[HeldPiece]) -> None:
    """Make this holder's pieces durable, then read each back and check it: parity counts once verified."""
    keys = [piece_key(name, host, p.index, p.place) for p in held]
    repo.storage.sync(keys)
    for key, piece in zip(keys, held):
        check_chunk(repo.storage.read(key, max_size=piece.length), piece.digest, repo.storage.describe(key))


__all__ = ["piece_size", "protect_across_nodes"]
