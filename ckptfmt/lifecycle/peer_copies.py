"""Peer copies of a node-scoped tier (docs/design/many-nodes.md, part 2; spec 9.8): after each save.

Each node's leader (its lowest rank) sends the chunks its node holds of each new checkpoint to the
leaders of the next ``replicas`` nodes in node order (round robin), which check every chunk against
its name, write it to their own tier, read it back, and only then write a copy record
(``NAME/copy-<host>.json``): so that losing any ``replicas`` nodes' disks loses no checkpoint. Rows a
receiving node holds itself (a data-parallel job's replicated state) never travel. The bytes go over
the leaders' own gloo group (``peers``), on the manager's background thread, so copies never queue
behind the training collectives or the saves. Draining is ``peer_drains``; refilling a wiped node at a
restore, ``peer_refills``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ckptfmt.errors import CheckpointError
from ckptfmt.format.manifest import Chunk, Manifest
from ckptfmt.lifecycle.peers import SKIPPED, NodePeers, batches, pack, unpack
from ckptfmt.repository.chunk_reads import read_chunk
from ckptfmt.repository.copies import write_copy_record
from ckptfmt.repository.repository import Repository


def copy_to_peers(peers: NodePeers, name: str, yield_to: Callable[[], object] | None = None) -> list[str]:
    """Send this node's chunks of checkpoint ``name`` to the next nodes and take the previous ones'
    (every leader calls this for every checkpoint, in the same order); what failed, in words.
    ``yield_to`` is called before each message and may block (while the training loop saves)."""
    if peers.group is None or not peers.survives:
        return []
    if peers.broken is not None:
        return [f"peer copy of {name} skipped: {peers.broken}"]
    repo: Repository | None = None
    try:
        repo = peers.open_tier()
        record = repo.commit(name)
        manifest: Manifest | None = repo.manifest(name, record, skip=SKIPPED)
        digest: str | None = record.manifest_hash
    except CheckpointError:
        manifest = digest = None  # not committed on this node: no copies to or from it
    problems: list[str] = []
    count = len(peers.nodes.hosts)
    try:  # every leader takes its turn, whatever its own node holds: the others expect it
        digests = peers.all_gather(digest)
        for shift in range(1, peers.survives + 1):
            to, source = (peers.index + shift) % count, (peers.index - shift) % count
            sending = digest is not None and digests[to] == digest
            receiving = digest is not None and digests[source] == digest
            problems += _exchange(peers, repo, name, manifest, digest, to if sending else None,
                                  source if receiving else None, yield_to)
    except RuntimeError as exc:  # gloo: a peer died or timed out; the next checkpoints are not tried
        problems.append(peers.fail(f"at {name}", exc))
    return problems


def _exchange(peers: NodePeers, repo: Repository | None, name: str, manifest: Manifest | None, digest: str | None,
              to: int | None, source: int | None, yield_to: Callable[[], object] | None) -> list[str]:
    """One shift of the ring: this node's rows to node ``to``, node ``source``'s rows from it (None:
    not that way); both sides cut the same batches from the manifest, so every message is expected.
    A node that holds no checkpoint (``repo`` None: its tier could not even be opened) moves nothing."""
    if repo is None or manifest is None:
        assert to is None and source is None
        return []
    hosts = peers.nodes.hosts
    outgoing = _rows_for(manifest, hosts[peers.index], hosts[to]) if to is not None else []
    incoming = _rows_for(manifest, hosts[source], hosts[peers.index]) if source is not None else []
    chunks = manifest.chunks if manifest is not None else []
    sends, receives = batches(chunks, outgoing), batches(chunks, incoming)
    received: list[tuple[str, Chunk]] = []
    problems: list[str] = []
    for round_ in range(max(len(sends), len(receives))):
        if yield_to is not None:
            yield_to()
        works: list = []
        buffer = None
        if round_ < len(sends):
            payload = pack(repo, chunks, sends[round_], problems)
            works.append(dist.isend(payload, group=peers.group, group_dst=to))
        if round_ < len(receives):
            buffer = torch.empty(sum(chunks[row].stored_size for row in receives[round_]), dtype=torch.uint8)
            works.append(dist.irecv(buffer, group=peers.group, group_src=source))
        for work in works:
            work.wait()
        if buffer is not None and source is not None:
            try:
                received += unpack(repo, chunks, receives[round_], buffer)
            except CheckpointError as exc:
                problems.append(f"copy of {name} from {hosts[source]} refused: {exc}")
    if source is not None and not problems:
        assert digest is not None
        try:
            _verify_arrived(repo, received)
            write_copy_record(repo, name, hosts[source], digest, len(received),
                              sum(chunk.stored_size for _, chunk in received))
        except CheckpointError as exc:
            problems.append(f"copy of {name} from {hosts[source]} not recorded: {exc}")
    return problems


def _rows_for(manifest: Manifest | None, sender: str, receiver: str) -> list[int]:
    """The chunk rows of node ``sender`` that node ``receiver`` does not hold itself."""
    placement = manifest.placement if manifest is not None else None
    if placement is None:
        return []
    node, theirs = placement.node(sender), placement.node(receiver)
    if node is None:
        return []
    held = set(theirs.rows) if theirs is not None else set()
    return [row for row in node.rows if row not in held]


def _verify_arrived(repo: Repository, received: list[tuple[str, Chunk]]) -> None:
    """Make the received chunks durable, then read each back and check it against its name: a copy counts
    once verified where it is."""
    repo.storage.sync([key for key, _ in received])
    for key, chunk in received:
        read_chunk(repo.storage, key, chunk)
