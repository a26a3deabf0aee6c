"""Peer copies of a node-scoped tier (docs/design/many-nodes.md, parts 2 and 4; spec 9.8).

Each node's leader (its lowest rank) sends the chunks its node holds of each new checkpoint to the
leaders of the next ``replicas`` nodes in node order (round robin), which check every chunk against
its name, write it to their own tier, read it back, and only then write a copy record
(``NAME/copy-<host>.json``): so that losing any ``replicas`` nodes' disks loses no checkpoint. Rows a
receiving node holds itself (a data-parallel job's replicated state) never travel. The bytes go over
a gloo group of the leaders made for this alone, on the manager's background thread, so copies never
queue behind the training collectives or the saves.

Draining (part 3): the checkpoints the next tier's retention wants are copied there by every leader,
each sending the rows of its node that no node before it holds, and committed there by rank 0's node
once every leader has sent and checked its part.

At a restore, the leaders pool what each node holds (its own rows, and its copies of others'), agree
on the newest checkpoint that every node's rows are somewhere for, and a node that lacks its own rows
(its disk was replaced) gets them, with the manifest, commit record and signatures, from the first
node holding a copy: its tier then holds the checkpoint again, and its ranks load it from there.
"""

from __future__ import annotations

import socket
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError, CheckpointWarning
from ckptfmt.format import codecs, layout
from ckptfmt.format.chunk_table import stored_key
from ckptfmt.format.commit_record import CommitRecord
from ckptfmt.format.hashing import check_chunk
from ckptfmt.format.manifest import Chunk, Manifest, optional_fields_except
from ckptfmt.format.signatures import is_signature_entry
from ckptfmt.format.version import FORMAT_VERSION
from ckptfmt.groups.process_group import RankGroup, peer_group
from ckptfmt.lifecycle.housekeeping import Tier
from ckptfmt.lifecycle.replicate import commit_copy, copy_rows
from ckptfmt.repository.chunk_reads import read_chunk
from ckptfmt.repository.copies import copy_records, write_copy_record
from ckptfmt.repository.leases import save_lease
from ckptfmt.repository.repository import Repository
from ckptfmt.tools.formatting import counted

#: Chunk bytes sent in one message at most (a larger chunk goes alone): what a leader holds at a time.
BATCH_BYTES = 64 << 20
#: Chunks each node sends to the next tier at a time while draining.
DRAIN_WORKERS = 2
#: The manifest's fields these copies do without (the chunk table and the placement are all they read).
_SKIPPED = optional_fields_except("placement")


@dataclass(frozen=True)
class Held:
    """What one node's tier holds of one checkpoint: its manifest hash and step, and the placement hosts
    whose rows are there (its own, if it is one of them, and its verified copies)."""

    manifest_hash: str
    step: int | None
    created_ns: int
    nodes: tuple[str, ...]
    hosts: frozenset[str]


class PeerCopies:
    """One rank's part in the peer copies of ``tier`` (node-scoped) over ``group``: made by every rank
    together; only the nodes' leaders copy."""

    def __init__(self, tier: Tier, group, replicas: int, timeout_s: float,
                 format_version: tuple[int, int] = FORMAT_VERSION):
        self.tier = tier
        #: The version a node tier this creates is written for (its saves' ``format_version=``).
        self.format_version = format_version
        self.ranks = RankGroup(group, timeout_s, "finding each node's leader")
        self.host = socket.gethostname()
        hosts = self.ranks.broadcast(self.ranks.gather(self.host))
        #: The job's nodes, in the order of their lowest rank, and each one's ranks (in ``group``).
        self.hosts = list(dict.fromkeys(hosts))
        self.node_ranks = {host: tuple(rank for rank, h in enumerate(hosts) if h == host) for host in self.hosts}
        self.index = self.hosts.index(self.host)
        self.is_leader = self.node_ranks[self.host][0] == self.ranks.rank
        self.replicas = max(0, min(replicas, len(self.hosts) - 1))
        self.group = None
        if self.is_leader and len(self.hosts) > 1:
            leaders = [self.ranks.global_ranks[self.node_ranks[host][0]] for host in self.hosts]
            self.group = peer_group(leaders, timeout_s, "peer copies")
        self._broken: str | None = None

    # -- after each save, on every leader -----------------------------------------------------
    def copy(self, name: str, yield_to: Callable[[], object] | None = None) -> list[str]:
        """Send this node's chunks of checkpoint ``name`` to the next nodes and take the previous ones'
        (every leader calls this for every checkpoint, in the same order); what failed, in words.
        ``yield_to`` is called before each message and may block (while the training loop saves)."""
        if self.group is None or not self.replicas:
            return []
        if self._broken is not None:
            return [f"peer copy of {name} skipped: {self._broken}"]
        try:
            repo = Repository.open(self.tier.url, self.tier.storage_options, create=True,
                                   format_version=self.format_version)
            record = repo.commit(name)
            manifest: Manifest | None = repo.manifest(name, record, skip=_SKIPPED)
            digest: str | None = record.manifest_hash
        except CheckpointError:
            manifest = digest = None  # not committed on this node: no copies to or from it
        problems: list[str] = []
        try:  # every leader takes its turn, whatever its own node holds: the others expect it
            digests = self._all_gather(digest)
            for shift in range(1, self.replicas + 1):
                to, source = (self.index + shift) % len(self.hosts), (self.index - shift) % len(self.hosts)
                sending = digest is not None and digests[to] == digest
                receiving = digest is not None and digests[source] == digest
                problems += self._exchange(repo, name, manifest, digest, to if sending else None,
                                           source if receiving else None, yield_to)
        except RuntimeError as exc:  # gloo: a peer died or timed out; the next checkpoints are not tried
            self._broken = f"the peers' group failed at {name} ({' '.join(str(exc).split())[:300]})"
            problems.append(self._broken)
        return problems

    def _exchange(self, repo: Repository, name: str, manifest: Manifest | None, digest: str | None,
                  to: int | None, source: int | None, yield_to: Callable[[], object] | None) -> list[str]:
        """One shift of the ring: this node's rows to node ``to``, node ``source``'s rows from it (None:
        not that way); both sides cut the same batches from the manifest, so every message is expected."""
        assert manifest is not None or (to is None and source is None)
        outgoing = self._rows_for(manifest, self.hosts[self.index], self.hosts[to]) if to is not None else []
        incoming = self._rows_for(manifest, self.hosts[source], self.hosts[self.index]) if source is not None else []
        chunks = manifest.chunks if manifest is not None else []
        sends, receives = _batches(chunks, outgoing), _batches(chunks, incoming)
        received: list[tuple[str, Chunk]] = []
        problems: list[str] = []
        for round_ in range(max(len(sends), len(receives))):
            if yield_to is not None:
                yield_to()
            works: list = []
            buffer = None
            if round_ < len(sends):
                payload = _pack(repo, chunks, sends[round_], problems)
                works.append(dist.isend(payload, group=self.group, group_dst=to))
            if round_ < len(receives):
                buffer = torch.empty(sum(chunks[row].stored_size for row in receives[round_]), dtype=torch.uint8)
                works.append(dist.irecv(buffer, group=self.group, group_src=source))
            for work in works:
                work.wait()
            if buffer is not None and source is not None:
                try:
                    received += _unpack(repo, chunks, receives[round_], buffer)
                except CheckpointError as exc:
                    problems.append(f"copy of {name} from {self.hosts[source]} refused: {exc}")
        if source is not None and not problems:
            assert digest is not None
            try:
                _verify_arrived(repo, received)
                write_copy_record(repo, name, self.hosts[source], digest, len(received),
                                  sum(chunk.stored_size for _, chunk in received))
            except CheckpointError as exc:
                problems.append(f"copy of {name} from {self.hosts[source]} not recorded: {exc}")
        return problems

    # -- draining to the next tier, on every leader -------------------------------------------
    def drain(self, target: Tier, wanted: Callable[[], list[str]] | None,
              yield_to: Callable[[], object] | None = None) -> list[str]:
        """Copy to ``target`` the checkpoints its retention wants (``wanted``, called on rank 0's node:
        the others get its answer), each node sending the rows no node before it holds, and commit each
        there (on rank 0's node) once every node has sent and checked its part: the next tier never
        shows a partial checkpoint. A node that fails leaves that checkpoint for the next drain. Every
        leader calls this after each ``copy``; what failed, in words. ``yield_to``: as for ``copy``,
        before each chunk."""
        if self.group is None:
            return []
        if self._broken is not None:
            return [f"draining to {target.url} skipped: {self._broken}"]
        try:
            names = [wanted() if self.index == 0 and wanted is not None else None]
            dist.broadcast_object_list(names, group=self.group, group_src=0)
            if not names[0]:
                return []
            return self._drain(names[0], target, yield_to)
        except RuntimeError as exc:
            self._broken = f"the peers' group failed while draining ({' '.join(str(exc).split())[:300]})"
            return [self._broken]

    def _drain(self, names: list[str], target: Tier, yield_to: Callable[[], object] | None) -> list[str]:
        repo = Repository.open(self.tier.url, self.tier.storage_options, create=True,
                               format_version=self.format_version)
        shared = Repository.open(target.url, target.storage_options, create=True, format_version=repo.format_version)
        failures: dict[str, str] = {}
        records, manifests = {}, {}
        with save_lease(shared) as lease:  # from before the first chunk to after rank 0's commit
            for name in names:
                try:
                    record = records[name] = repo.commit(name)
                    manifest = manifests[name] = repo.manifest(name, record, skip=_SKIPPED)
                    copy_rows(repo, shared, record, self._rows_to_drain(manifest), workers=DRAIN_WORKERS,
                              yield_to=yield_to)
                except CheckpointError as exc:
                    failures[name] = f"{self.host}: {exc}"
            everyone = self._all_gather(failures)
            problems = [f"{name} not drained to {target.url}: {message}"
                        for each in everyone for name, message in each.items()]
            if self.index == 0:
                for name in names:
                    if any(name in each for each in everyone):
                        continue
                    try:
                        _check_every_chunk_there(repo, shared, records[name])
                        _record_every_node(shared, records[name], manifests[name])
                        commit_copy(repo, shared, records[name], lease)
                    except CheckpointError as exc:
                        problems.append(f"{name} not committed on {target.url}: {exc}")
            self._all_gather(None)  # every node keeps its lease until the commits are made
        return problems if self.index == 0 else []

    def _rows_to_drain(self, manifest: Manifest) -> list[int]:
        """This node's rows that no node before it (in placement order) holds: each chunk is sent once."""
        placement = manifest.placement
        if placement is None:
            return list(range(len(manifest.chunks))) if self.index == 0 else []
        earlier: set[int] = set()
        for node in placement.nodes:
            if node.host == self.host:
                return [row for row in node.rows if row not in earlier]
            earlier.update(node.rows)
        return []

    @staticmethod
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

    # -- at a restore, on every rank ------------------------------------------------------------
    def restore_point(self) -> tuple[int | None, list[str]]:
        """The step of the newest checkpoint whose every node's rows are on some node, made whole on
        every node (a node without its own rows gets them from a copy), or None where there is none;
        and what was fetched from where, in words (the same on every rank)."""
        outcome: tuple[int | None, list[str], str | None] = (None, [], None)
        if self.is_leader:
            outcome = self._agree_and_fill()
        gathered = self.ranks.gather(outcome)  # every leader has filled its tier, or failed to
        decided = None
        if gathered is not None:
            failures = [failure for _, _, failure in gathered if failure is not None]
            step, fetched, _ = gathered[0]
            if failures:  # a node could not be made whole: the caller falls back to the other tiers
                warnings.warn(f"restore from the nodes' copies given up: {failures[0]}", CheckpointWarning,
                              stacklevel=3)
                step, fetched = None, []
            decided = (step, fetched)
        return self.ranks.broadcast(decided)

    def _agree_and_fill(self) -> tuple[int | None, list[str], str | None]:
        """On a leader: the step agreed, what was fetched, and what failed here (None: nothing)."""
        try:
            repo = Repository.open(self.tier.url, self.tier.storage_options, create=True,
                                   format_version=self.format_version)
            inventory = _inventory(repo, self.host)
        except CheckpointError as exc:  # this node's tier is unreadable: it holds nothing, and says so
            repo, inventory = None, {}
            failure: str | None = f"{self.host}: {exc}"
        else:
            failure = None
        inventories = [inventory] if self.group is None else self._all_gather(inventory)
        chosen = self._newest_whole(inventories)
        if chosen is None:
            return None, [], failure
        name, held = chosen
        fetched = []
        for receiver, host in enumerate(self.hosts):  # the same hosts as the checkpoint's (_newest_whole)
            if host in inventories[receiver].get(name, _NOTHING).hosts:
                continue
            donor = next(i for i, each in enumerate(inventories) if host in each.get(name, _NOTHING).hosts)
            try:  # both ends go through every message, so that a failure leaves no one waiting
                if self.index == donor and repo is not None:
                    self._send_checkpoint(repo, name, host, receiver)
                elif self.index == receiver and repo is not None:
                    self._receive_checkpoint(repo, name, host, donor)
            except CheckpointError as exc:
                failure = failure or f"{self.host}: {exc}"
            fetched.append(f"{host}'s chunks of {name} from {self.hosts[donor]}'s copy")
        return held.step, fetched, failure

    def _newest_whole(self, inventories: list[dict[str, Held]]) -> tuple[str, Held] | None:
        """The newest checkpoint (one manifest everywhere it is), saved by the job's nodes as they are
        now (the same hosts), of which every node's rows are held by some node."""
        names: dict[str, Held] = {}
        for inventory in inventories:
            for name, held in inventory.items():
                names.setdefault(name, held)
        for name, held in sorted(names.items(), key=lambda item: (item[1].created_ns, item[0]), reverse=True):
            if any(name in each and each[name].manifest_hash != held.manifest_hash for each in inventories):
                continue
            everywhere = frozenset().union(*(each[name].hosts for each in inventories if name in each))
            if set(held.nodes) == set(self.hosts) and set(held.nodes) <= everywhere:
                return name, held
        return None

    def _send_checkpoint(self, repo: Repository, name: str, host: str, receiver: int) -> None:
        """To node ``receiver``: checkpoint ``name``'s small objects, then node ``host``'s chunks (or, where
        they cannot be read here, what went wrong, and nothing more)."""
        try:
            record = repo.commit(name)
            manifest = repo.manifest(name, record, skip=_SKIPPED)
            objects = {}
            for entry in repo.storage.list(name):
                if entry.startswith("manifest-") and record.manifest_hash in entry or is_signature_entry(entry):
                    key = f"{name}/{entry}"
                    objects[key] = repo.storage.read(key, max_size=max(record.manifest_size, 1 << 16))
        except CheckpointError as exc:
            dist.send_object_list([None, f"{self.host}: {exc}"], group=self.group, group_dst=receiver)
            raise
        dist.send_object_list([record.to_dict(), objects], group=self.group, group_dst=receiver)
        damaged: list[str] = []
        for batch in _batches(manifest.chunks, list(_rows_of(manifest, host))):
            dist.send(_pack(repo, manifest.chunks, batch, damaged), group=self.group, group_dst=receiver)
        if damaged:  # the receiver refuses the zeros sent in its place: neither node restores from this copy
            raise CheckpointError(f"{name}: {damaged[0]}")

    def _receive_checkpoint(self, repo: Repository, name: str, host: str, donor: int) -> None:
        """From node ``donor``: checkpoint ``name`` whole on this node's tier, every object checked."""
        message: list = [None, None]
        dist.recv_object_list(message, group=self.group, group_src=donor)
        if message[0] is None:
            raise CheckpointError(f"{name}: the copy on {self.hosts[donor]} could not be read ({message[1]})")
        where = repo.storage.describe(name)
        record = CommitRecord.from_dict(message[0], where)
        objects: dict[str, bytes] = message[1]
        manifest_key = next(key for key in objects if key.startswith(f"{name}/manifest-"))
        data = objects[manifest_key]
        check_chunk(data, record.manifest_hash, repo.storage.describe(manifest_key))
        manifest = Manifest.from_bytes(data, repo.storage.describe(manifest_key), skip=_SKIPPED)
        received, refused = [], []
        for batch in _batches(manifest.chunks, list(_rows_of(manifest, host))):
            buffer = torch.empty(sum(manifest.chunks[row].stored_size for row in batch), dtype=torch.uint8)
            dist.recv(buffer, group=self.group, group_src=donor)
            try:  # every message is taken, so that the donor is never left waiting
                received += _unpack(repo, manifest.chunks, batch, buffer)
            except CheckpointError as exc:
                refused.append(str(exc))
        if refused:
            raise CheckpointError(f"{name}: the copy from {self.hosts[donor]} refused: {refused[0]}")
        with save_lease(repo) as lease:  # checked on arrival; the load that follows reads and checks them again
            repo.storage.sync([key for key, _ in received])
            for key, value in objects.items():
                repo.storage.write(key, value, durable=False)
            repo.storage.sync(list(objects))
            lease.check("writing the commit record")
            repo.declare(record.version, manifest.requires)
            repo.create_commit(record)

    def _all_gather(self, value):
        out = [None] * len(self.hosts)
        dist.all_gather_object(out, value, group=self.group)
        return out


_NOTHING = Held("", None, 0, (), frozenset())


def _inventory(repo: Repository, host: str) -> dict[str, Held]:
    """What this node's tier holds of each committed checkpoint."""
    found = {}
    for record in repo.commits():
        try:
            manifest = repo.manifest(record.name, record, skip=_SKIPPED)
        except CheckpointError as exc:
            warnings.warn(f"{repo.url} on {host}: {record.name} not counted ({exc})", CheckpointWarning, stacklevel=2)
            continue
        if manifest.placement is None:
            continue
        nodes = tuple(node.host for node in manifest.placement.nodes)
        hosts = set(copy_records(repo, record.name, record.manifest_hash))
        if host in nodes:
            hosts.add(host)
        found[record.name] = Held(record.manifest_hash, record.step, record.created_ns, nodes, frozenset(hosts))
    return found


def _check_every_chunk_there(repo: Repository, shared: Repository, record: CommitRecord) -> None:
    """Before the commit on the next tier: every chunk of the checkpoint is there, at its stored size
    (each node checked its own part's bytes; this catches a part no node sent)."""
    chunks = repo.manifest(record.name, record, skip=_SKIPPED).chunks
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


def _rows_of(manifest: Manifest, host: str) -> tuple[int, ...]:
    node = manifest.placement.node(host) if manifest.placement is not None else None
    return node.rows if node is not None else ()


def _batches(chunks: list[Chunk], rows: list[int]) -> list[list[int]]:
    """``rows`` cut into messages of at most ``BATCH_BYTES`` (a larger chunk alone); empty chunks travel
    in whichever message they fall in, as no bytes."""
    batches: list[list[int]] = []
    size = BATCH_BYTES
    for row in rows:
        stored = chunks[row].stored_size
        if not batches or size + stored > BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(row)
        size += stored
    return batches


def _pack(repo: Repository, chunks: list[Chunk], rows: list[int], problems: list[str]) -> torch.Tensor:
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


def _unpack(repo: Repository, chunks: list[Chunk], rows: list[int], buffer: torch.Tensor) -> list[tuple[str, Chunk]]:
    """Write the rows' chunks from ``buffer``, each checked against its name first; their keys."""
    data, at, written = buffer.numpy(), 0, []
    for row in rows:
        chunk = chunks[row]
        key = stored_key(chunks, chunk)
        stored = data[at:at + chunk.stored_size].tobytes()
        at += chunk.stored_size
        where = f"{repo.storage.describe(key)} (as received)"
        check_chunk(codecs.decode(chunk.codec, stored, chunk.size, where, None), chunk.hash, where)
        repo.storage.write(key, stored, durable=False)
        written.append((key, chunk))
    return written


def _verify_arrived(repo: Repository, received: list[tuple[str, Chunk]]) -> None:
    """Make the received chunks durable, then read each back and check it against its name: a copy counts
    once verified where it is."""
    repo.storage.sync([key for key, _ in received])
    for key, chunk in received:
        read_chunk(repo.storage, key, chunk)
