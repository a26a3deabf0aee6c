"""Draining a node-scoped tier to the next tier (docs/design/many-nodes.md, part 3; spec 9.8).

The checkpoints the next tier's retention wants are copied there by every node's leader, each sending
the rows of its node that no node before it holds, and committed there by rank 0's node once every
leader has sent and checked its part: the next tier never shows a partial checkpoint. The leaders
agree over their own group (``peers``), after each round of peer copies (``peer_copies``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError
from ckptfmt.format import layout
from ckptfmt.format.chunk_table import stored_key
from ckptfmt.format.commit_record import CommitRecord
from ckptfmt.format.manifest import Manifest
from ckptfmt.lifecycle.housekeeping import Tier
from ckptfmt.lifecycle.peers import SKIPPED, NodePeers
from ckptfmt.lifecycle.replicate import commit_copy, copy_rows
from ckptfmt.repository.copies import write_copy_record
from ckptfmt.repository.leases import save_lease
from ckptfmt.repository.repository import Repository
from ckptfmt.tools.formatting import counted

#: Chunks each node sends to the next tier at a time while draining.
DRAIN_WORKERS = 2


def drain(peers: NodePeers, target: Tier, wanted: Callable[[], list[str]] | None,
          yield_to: Callable[[], object] | None = None) -> list[str]:
    """Copy to ``target`` the checkpoints its retention wants (``wanted``, called on rank 0's node:
    the others get its answer), each node sending the rows no node before it holds, and commit each
    there (on rank 0's node) once every node has sent and checked its part: the next tier never
    shows a partial checkpoint. A node that fails leaves that checkpoint for the next drain. Every
    leader calls this after each ``copy_to_peers``; what failed, in words. ``yield_to``: as for
    ``copy_to_peers``, before each chunk."""
    if peers.group is None:
        return []
    if peers.broken is not None:
        return [f"draining to {target.url} skipped: {peers.broken}"]
    try:
        names = [wanted() if peers.index == 0 and wanted is not None else None]
        dist.broadcast_object_list(names, group=peers.group, group_src=0)
        if not names[0]:
            return []
        return _drain(peers, names[0], target, yield_to)
    except RuntimeError as exc:
        return [peers.fail("while draining", exc)]


def _drain(peers: NodePeers, names: list[str], target: Tier, yield_to: Callable[[], object] | None) -> list[str]:
    repo = peers.open_tier()
    shared = Repository.open(target.url, target.storage_options, create=True, format_version=repo.format_version)
    failures: dict[str, str] = {}
    records, manifests = {}, {}
    with save_lease(shared) as lease:  # from before the first chunk to after rank 0's commit
        for name in names:
            try:
                record = records[name] = repo.commit(name)
                manifest = manifests[name] = repo.manifest(name, record, skip=SKIPPED)
                copy_rows(repo, shared, record, _rows_to_drain(peers, manifest), workers=DRAIN_WORKERS,
                          yield_to=yield_to)
            except CheckpointError as exc:
                failures[name] = f"{peers.host}: {exc}"
        everyone = peers.all_gather(failures)
        problems = [f"{name} not drained to {target.url}: {message}"
                    for each in everyone for name, message in each.items()]
        if peers.index == 0:
            for name in names:
                if any(name in each for each in everyone):
                    continue
                try:
                    _check_every_chunk_there(repo, shared, records[name])
                    _record_every_node(shared, records[name], manifests[name])
                    commit_copy(repo, shared, records[name], lease)
                except CheckpointError as exc:
                    problems.append(f"{name} not committed on {target.url}: {exc}")
        peers.all_gather(None)  # every node keeps its lease until the commits are made
    return problems if peers.index == 0 else []


def _rows_to_drain(peers: NodePeers, manifest: Manifest) -> list[int]:
    """This node's rows that no node before it (in placement order) holds: each chunk is sent once."""
    placement = manifest.placement
    if placement is None:
        return list(range(len(manifest.chunks))) if peers.index == 0 else []
    earlier: set[int] = set()
    for node in placement.nodes:
        if node.host == peers.host:
            return [row for row in node.rows if row not in earlier]
        earlier.update(node.rows)
    return []


def _check_every_chunk_there(repo: Repository, shared: Repository, record: CommitRecord) -> None:
    """Before the commit on the next tier: every chunk of the checkpoint is there, at its stored size
    (each node checked its own part's bytes; this catches a part no node sent)."""
    chunks = repo.manifest(record.name, record, skip=SKIPPED).chunks
    stored = shared.storage.find(layout.CHUNKS_DIR)
    missing = [key for key, chunk in ((stored_key(chunks, c), c) for c in chunks)
               if stored.get(key) != chunk.stored_size]
    if missing:
        raise CheckpointNotFoundError(f"{shared.storage.describe(missing[0])}: chunk is missing "
                                      f"({counted(len(missing), 'chunk')} no node sent)")


def _record_every_node(shared: Repository, record: CommitRecord, manifest: Manifest) -> None:
    """A copy record for every node of a drained checkpoint's placement (spec 9.8): the next tier holds
    every node's rows, so a reader there on one of the nodes checks them all, as a reader anywhere else
    does, rather than taking the other nodes' chunks as held on their own disks."""
    if manifest.placement is None:
        return
    chunks = manifest.chunks
    for node in manifest.placement.nodes:
        write_copy_record(shared, record.name, node.host, record.manifest_hash, len(node.rows),
                          sum(chunks[row].stored_size for row in node.rows))
