"""Refilling a node-scoped tier at a restore (docs/design/many-nodes.md, part 4; spec 9.8).

The leaders pool what each node holds (its own rows, its copies of others' from ``peer_copies``, the
parity it keeps from ``peer_parity``), agree on the newest checkpoint that every node's rows are
somewhere for or can be rebuilt, and a node that lacks its own rows (its disk was replaced) gets them,
with the manifest, commit record and signatures, from the first node holding a copy, or rebuilt from
the parity across nodes (``peer_parity_refills``): its tier then holds the checkpoint again, and its
ranks load it from there.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ckptfmt.errors import CheckpointError, CheckpointWarning
from ckptfmt.format import layout
from ckptfmt.format.commit_record import CommitRecord
from ckptfmt.format.hashing import check_chunk
from ckptfmt.format.manifest import Chunk, Manifest
from ckptfmt.format.signatures import is_signature_entry
from ckptfmt.lifecycle.peer_parity_refills import ParityHeld, Step, held_parity, plan, rebuild_rows
from ckptfmt.lifecycle.peers import SKIPPED, NodePeers, batches, pack, unpack
from ckptfmt.repository.copies import copy_records
from ckptfmt.repository.leases import save_lease
from ckptfmt.repository.repository import Repository


@dataclass(frozen=True)
class Held:
    """What one node's tier holds of one checkpoint: its manifest hash and step, and the placement hosts
    whose rows are there (its own, if it is one of them, and its verified copies)."""

    manifest_hash: str
    step: int | None
    created_ns: int
    nodes: tuple[str, ...]
    hosts: frozenset[str]
    #: The parity across nodes this node keeps of it (None: none).
    parity: ParityHeld | None = None


_NOTHING = Held("", None, 0, (), frozenset())


def restore_point(peers: NodePeers) -> tuple[int | None, list[str], str | None]:
    """The step of the newest checkpoint whose every node's rows are on some node, made whole on
    every node (a node without its own rows gets them from a copy, or rebuilt from parity), or None
    where there is none; what was fetched from where, in words; and the checkpoint rebuilt from parity
    (its rebuilt nodes lack the parity they held: the caller computes it again), or None. The same on
    every rank; every rank calls this."""
    outcome: tuple[int | None, list[str], str | None, str | None] = (None, [], None, None)
    if peers.is_leader:
        outcome = _agree_and_fill(peers)
    gathered = peers.ranks.gather(outcome)  # every leader has filled its tier, or failed to
    decided = None
    if gathered is not None:
        failures = [failure for _, _, failure, _ in gathered if failure is not None]
        step, fetched, _, rebuilt = gathered[0]
        if failures:  # a node could not be made whole: the caller falls back to the other tiers
            step, fetched, rebuilt = None, [], None
        decided = (step, fetched, failures[0] if failures else None, rebuilt)
    step, fetched, failure, rebuilt = peers.ranks.broadcast(decided)
    if failure is not None:  # on every rank: each one's log says why it reads another tier
        warnings.warn(f"restore from the nodes' tiers given up: {failure}", CheckpointWarning, stacklevel=3)
    return step, fetched, rebuilt


def _agree_and_fill(peers: NodePeers) -> tuple[int | None, list[str], str | None, str | None]:
    """On a leader: the step agreed, what was fetched, what failed here (None: nothing), and the
    checkpoint rebuilt from parity (None: none)."""
    try:
        repo = peers.open_tier()
        inventory = _inventory(repo, peers.host)
    except CheckpointError as exc:  # this node's tier is unreadable: it holds nothing, and says so
        repo, inventory = None, {}
        failure: str | None = f"{peers.host}: {exc}"
    else:
        failure = None
    inventories = [inventory] if peers.group is None else peers.all_gather(inventory)
    chosen, why = _newest_whole(peers.nodes.hosts, inventories)
    if chosen is None:
        return None, [], failure or why, None
    name, held, steps = chosen
    hosts = peers.nodes.hosts
    fetched, lost = [], []
    for receiver, host in enumerate(hosts):  # the same hosts as the checkpoint's (_newest_whole)
        if host in inventories[receiver].get(name, _NOTHING).hosts:
            continue
        donor = next((i for i, each in enumerate(inventories) if host in each.get(name, _NOTHING).hosts), None)
        if donor is None:  # rebuilt from parity, below
            lost.append(receiver)
            continue
        try:  # both ends go through every message, so that a failure leaves no one waiting
            if peers.index == donor and repo is not None:
                _send_checkpoint(peers, repo, name, host, receiver)
            elif peers.index == receiver and repo is not None:
                _receive_checkpoint(peers, repo, name, host, donor)
        except CheckpointError as exc:
            failure = failure or f"{peers.host}: {exc}"
        fetched.append(f"{host}'s chunks of {name} from {hosts[donor]}'s copy")
    if lost:
        failure = _rebuild(peers, repo, name, held, steps or [], inventories, lost) or failure
        fetched += [f"{hosts[receiver]}'s chunks of {name} rebuilt from the parity across nodes" for receiver in lost]
    return held.step, fetched, failure, name if lost else None


def _newest_whole(hosts: tuple[str, ...], inventories: list[dict[str, Held]]
                  ) -> tuple[tuple[str, Held, list[Step] | None] | None, str | None]:
    """The newest checkpoint (one manifest everywhere it is), saved by the job's nodes as they are
    now (the same ``hosts``), of which every node's rows are held by some node or rebuilt from parity
    (the rounds to rebuild, else None); or None, and why the newest was not whole (None: none to try)."""
    names: dict[str, Held] = {}
    for inventory in inventories:
        for name, held in inventory.items():
            names.setdefault(name, held)
    why = None
    for name, held in sorted(names.items(), key=lambda item: (item[1].created_ns, item[0]), reverse=True):
        if any(name in each and each[name].manifest_hash != held.manifest_hash for each in inventories):
            continue
        if set(held.nodes) != set(hosts):
            continue
        everywhere = frozenset().union(*(each[name].hosts for each in inventories if name in each))
        missing = set(held.nodes) - everywhere
        if not missing:
            return (name, held, None), None
        try:
            return (name, held, _parity_plan(hosts, inventories, name, held, missing)), None
        except CheckpointError as exc:
            why = why or f"{name}: {exc}"
    return None, why


def _parity_plan(hosts: tuple[str, ...], inventories: list[dict[str, Held]], name: str, held: Held,
                 missing: set[str]) -> list[Step]:
    """The rounds that rebuild the ``missing`` nodes' rows of ``name`` from the parity across nodes."""
    at = {host: hosts.index(host) for host in held.nodes}  # placement host -> job node
    parity: dict[int, ParityHeld] = {}
    for p, host in enumerate(held.nodes):
        kept = inventories[at[host]].get(name, _NOTHING).parity
        if kept is not None:
            parity[p] = kept
    if not parity:
        raise CheckpointError(f"{', '.join(sorted(missing))}'s rows are on no node, and no node keeps parity of them")
    intact = {p for p, host in enumerate(held.nodes) if host in inventories[at[host]].get(name, _NOTHING).hosts}
    lost = {p for p, host in enumerate(held.nodes) if host in missing}
    return plan(parity, intact, lost)


def _rebuild(peers: NodePeers, repo: Repository | None, name: str, held: Held, steps: list[Step],
             inventories: list[dict[str, Held]], lost: list[int]) -> str | None:
    """Every leader: the ``lost`` nodes get checkpoint ``name``'s small objects from a node holding it, then
    their rows rebuilt from parity (``steps``), and commit; what failed here (None: nothing)."""
    donor = next(i for i, each in enumerate(inventories) if name in each and i not in lost)
    received, problem = None, None
    for receiver in lost:
        try:
            if peers.index == donor and repo is not None:
                _send_objects(peers, repo, name, receiver)
            elif peers.index == receiver and repo is not None:
                received = _receive_objects(peers, repo, name, donor)
        except CheckpointError as exc:
            problem = problem or f"{peers.host}: {exc}"
    manifest = received[2] if received is not None else None
    if manifest is None and peers.index not in lost and repo is not None:
        try:
            manifest = repo.manifest(name, skip=SKIPPED)
        except CheckpointError as exc:
            problem = problem or f"{peers.host}: {exc}"
    hosts = peers.nodes.hosts
    try:
        written = rebuild_rows(peers, repo, name, manifest, steps, [hosts.index(h) for h in held.nodes],
                               held.nodes.index(peers.host))
        if received is not None and repo is not None:
            _commit_received(repo, *received, written)
    except CheckpointError as exc:
        problem = problem or f"{peers.host}: {name}: {exc}"
    return problem


def _send_checkpoint(peers: NodePeers, repo: Repository, name: str, host: str, receiver: int) -> None:
    """To node ``receiver``: checkpoint ``name``'s small objects, then node ``host``'s chunks (or, where
    they cannot be read here, what went wrong, and nothing more)."""
    manifest = _send_objects(peers, repo, name, receiver)
    damaged: list[str] = []
    for batch in batches(manifest.chunks, list(_rows_of(manifest, host))):
        dist.send(pack(repo, manifest.chunks, batch, damaged), group=peers.group, group_dst=receiver)
    if damaged:  # the receiver refuses the zeros sent in its place: neither node restores from this copy
        raise CheckpointError(f"{name}: {damaged[0]}")


def _send_objects(peers: NodePeers, repo: Repository, name: str, receiver: int) -> Manifest:
    """To node ``receiver``: checkpoint ``name``'s commit record, manifest and signatures (or what went
    wrong reading them, raised here too); its manifest."""
    try:
        record = repo.commit(name)
        manifest = repo.manifest(name, record, skip=SKIPPED)
        objects = {}
        for entry in repo.storage.list(name):
            if layout.manifest_digest(entry) == record.manifest_hash or is_signature_entry(entry):
                key = f"{name}/{entry}"
                objects[key] = repo.storage.read(key, max_size=max(record.manifest_size, 1 << 16))
    except CheckpointError as exc:
        dist.send_object_list([None, f"{peers.host}: {exc}"], group=peers.group, group_dst=receiver)
        raise
    dist.send_object_list([record.to_dict(), objects], group=peers.group, group_dst=receiver)
    return manifest


def _receive_checkpoint(peers: NodePeers, repo: Repository, name: str, host: str, donor: int) -> None:
    """From node ``donor``: checkpoint ``name`` whole on this node's tier, every object checked."""
    record, objects, manifest = _receive_objects(peers, repo, name, donor)
    received, refused = [], []
    for batch in batches(manifest.chunks, list(_rows_of(manifest, host))):
        buffer = torch.empty(sum(manifest.chunks[row].stored_size for row in batch), dtype=torch.uint8)
        dist.recv(buffer, group=peers.group, group_src=donor)
        try:  # every message is taken, so that the donor is never left waiting
            received += unpack(repo, manifest.chunks, batch, buffer)
        except CheckpointError as exc:
            refused.append(str(exc))
    if refused:
        raise CheckpointError(f"{name}: the copy from {peers.nodes.hosts[donor]} refused: {refused[0]}")
    _commit_received(repo, record, objects, manifest, received)


def _receive_objects(peers: NodePeers, repo: Repository, name: str,
                     donor: int) -> tuple[CommitRecord, dict[str, bytes], Manifest]:
    """From node ``donor``: checkpoint ``name``'s commit record, its objects by key and its manifest, checked."""
    message: list = [None, None]
    dist.recv_object_list(message, group=peers.group, group_src=donor)
    if message[0] is None:
        raise CheckpointError(f"{name}: the copy on {peers.nodes.hosts[donor]} could not be read ({message[1]})")
    where = repo.storage.describe(name)
    record = CommitRecord.from_dict(message[0], where)
    objects: dict[str, bytes] = message[1]
    manifest_key = next(key for key in objects if key.startswith(f"{name}/manifest-"))
    data = objects[manifest_key]
    check_chunk(data, record.manifest_hash, repo.storage.describe(manifest_key))
    return record, objects, Manifest.from_bytes(data, repo.storage.describe(manifest_key), skip=SKIPPED)


def _commit_received(repo: Repository, record: CommitRecord, objects: dict[str, bytes], manifest: Manifest,
                     received: list[tuple[str, Chunk]]) -> None:
    """The chunks ``received`` (checked on arrival) made durable, then the objects, then the commit record:
    the load that follows reads and checks them all again."""
    with save_lease(repo) as lease:
        repo.storage.sync([key for key, _ in received])
        for key, value in objects.items():
            repo.storage.write(key, value, durable=False)
        repo.storage.sync(list(objects))
        lease.check("writing the commit record")
        repo.declare(record.version, manifest.requires)
        repo.create_commit(record)


def _inventory(repo: Repository, host: str) -> dict[str, Held]:
    """What this node's tier holds of each committed checkpoint."""
    found = {}
    for record in repo.commits():
        try:
            manifest = repo.manifest(record.name, record, skip=SKIPPED)
        except CheckpointError as exc:
            warnings.warn(f"{repo.url} on {host}: {record.name} not counted ({exc})", CheckpointWarning, stacklevel=2)
            continue
        if manifest.placement is None:
            continue
        nodes = tuple(node.host for node in manifest.placement.nodes)
        hosts = set(copy_records(repo, record.name, record.manifest_hash))
        parity = None
        if host in nodes:
            hosts.add(host)
            parity = held_parity(repo, record.name, host, record.manifest_hash, manifest)
        found[record.name] = Held(record.manifest_hash, record.step, record.created_ns, nodes, frozenset(hosts),
                                  parity)
    return found


def _rows_of(manifest: Manifest, host: str) -> tuple[int, ...]:
    node = manifest.placement.node(host) if manifest.placement is not None else None
    return node.rows if node is not None else ()
