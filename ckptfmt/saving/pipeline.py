"""The save pipeline: every save, by one process or by every rank of a process group, runs this protocol.

Protocol (spec section 11.7), over a group of ``Ranks`` (``groups/``): a
process saving alone is a group of one (``SoloRanks``), whose collectives hand
values back as they are; the ranks of a torch.distributed group are
``RankGroup``. The coordinator is the member at position 0.

1. plan: every member encodes its own state (tensors become sources: plain
   tensors whole, DTensors as their local shard at its offsets) and sends the
   coordinator its value tree and tensor table. The coordinator takes the save
   lease, merges the value trees, checks that members agree on every tensor's
   dtype and shape, and gives each box of each tensor one writer among the
   members that hold it, balancing bytes (``planning.py``: a replicated tensor
   is stored once; a sharded one by its owners).
2. write: every member stores the boxes it was given, in parallel, durably
   (deltas against the parent's same boxes where asked), and reports its chunk
   table, RNG state, environment, topology and timing.
3. commit: once every member has reported, the coordinator writes the manifest
   and the commit record (``tables.py`` merges the chunk tables), and tells
   every member the outcome.

Any failure (an exception on a member, a member that never answers within the
timeout) means no commit. A process saving alone raises its own exception; in
a group every rank raises a ``CollectiveError`` naming the rank and its error.
Tensor bytes never pass between ranks.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import warnings
from contextlib import ExitStack, nullcontext
from typing import Any

from ckptfmt._collector import collector_paused
from ckptfmt.errors import CheckpointError, CheckpointWarning, CollectiveError
from ckptfmt.format.manifest import Manifest, ShardEntry, TensorEntry
from ckptfmt.format.placement import NodeChunks, Placement
from ckptfmt.format.values import encode_tree
from ckptfmt.groups.nodes import NodeLayout
from ckptfmt.groups.ranks import Ranks
from ckptfmt.metadata.timing import PhaseTimer
from ckptfmt.metadata.topology import topology_record
from ckptfmt.repository.leases import Lease
from ckptfmt.repository.repository import Repository, split_checkpoint_url
from ckptfmt.saving import replicas
from ckptfmt.saving.chunk_writer import store_sources
from ckptfmt.saving.core import commit_manifest
from ckptfmt.saving.delta_bases import DeltaBases
from ckptfmt.saving.hashcache import DEFAULT_CACHE
from ckptfmt.saving.manifests import manifest_for
from ckptfmt.saving.opening import open_for_save
from ckptfmt.saving.options import SaveOptions
from ckptfmt.saving.plan import PlannedTensor
from ckptfmt.saving.planning import Plan, RankPlan, decide
from ckptfmt.saving.records import Captured, rank_record, steps_record
from ckptfmt.saving.state_merge import MAX_REPORTED
from ckptfmt.saving.tables import ManifestTables, tensor_entry
from ckptfmt.saving.tensor_collector import TensorCollector
from ckptfmt.tensors.sources import TensorSource

#: What a rank that waited in vain for the others is told.
EVERY_RANK = ("Every rank of the process group must call ckptfmt.save, each with its own state; to save this "
              "rank's state alone (the 'if rank == 0' habit), pass coordinated=False")


def save_over(state: Any, url: str | os.PathLike, ranks: Ranks, options: SaveOptions, captured: Captured) -> str:
    """Save ``state`` (this member's part of it) as checkpoint ``url`` over ``ranks``; returns its URL.

    Python's cyclic collector is paused while each stage builds its records (a record per tensor, chunk
    and piece, none in a cycle), never while the save waits (for other ranks, for ``before_commit``): the
    pause is process-wide, and an asynchronous save's training thread goes on beside it."""
    url = os.fspath(url)
    timer = PhaseTimer(captured.staged)
    repo_url, name = split_checkpoint_url(url)
    together = ranks.count > 1
    captured = _with_gathered_steps(captured, options, ranks.rank)
    with timer.phase("join") if together else nullcontext():
        try:
            ranks.join()
        except CollectiveError as exc:
            raise CollectiveError(f"{exc}. {EVERY_RANK}") from None

    with timer.phase("prepare"):
        sources: list[TensorSource] = []
        entries: list[PlannedTensor] = []
        collector = TensorCollector(sources, entries, collective=ranks.collective, frozen=captured.frozen,
                                    tensor_stats=options.tensor_stats, device_stats=captured.device_stats)

        def prepare() -> RankPlan:
            with collector_paused():
                encoded = encode_tree(state, collector, rank=ranks.rank)
            collector.forget()
            compared = together and options.group.compares_replicas  # replicas exist only in a group
            return RankPlan(encoded, entries, [s.shape for s in sources], [s.nbytes for s in sources],
                            collector.meshes, replicas.fingerprints(sources) if compared else None,
                            socket.gethostname())
        plan, own_failure = _attempt(prepare)
    with ExitStack() as held:
        with timer.phase("plan" if together else "lease"):  # in a group, mostly waiting for the others
            plans = ranks.gather(_report(plan, own_failure, ranks.position))
            decision, failure = _coordinate(
                plans, ranks, lambda oks: decide(oks, ranks.rank_of, repo_url, name, options))
            if decision and "ok" in decision:  # the coordinator holds the save lease until the outcome
                held.callback(decision["ok"].lease.release)
            decision = ranks.broadcast(decision)
        return _write_and_commit(decision, own_failure or failure, url, name, repo_url, sources, entries, timer,
                                 ranks, options, captured)


def _write_and_commit(decision: dict, failure: Failure | None, url: str, name: str, repo_url: str,
                      sources: list[TensorSource], entries: list[PlannedTensor], timer: PhaseTimer,
                      ranks: Ranks, options: SaveOptions, captured: Captured) -> str:
    """Steps 2 and 3 of the protocol, once the plan is broadcast."""
    _raise_failures(decision, url, failure, ranks)
    agreed: Plan = decision["ok"]
    _heed_differences(agreed, url, ranks, options)
    node = NodeRepository(agreed.nodes, ranks, repo_url, options) if agreed.nodes is not None else None
    with ExitStack() as releasing:  # a leader's save lease on its node, however the save ends
        if node is not None:
            releasing.callback(node.release)
        written, own_failure = _attempt(
            lambda: _write(agreed, node, repo_url, sources, entries, timer, ranks, options, captured))
        # The encoding's records of each tensor are spent once its chunks are stored: freed before the
        # manifest is built (a save of 100,000 small tensors peaks there).
        sources.clear()
        entries.clear()  # where the write failed before it let go of them
        with timer.phase("wait_ranks") if ranks.count > 1 else nullcontext():
            results = ranks.gather(_report(written, own_failure, ranks.position))
        committed: list[Manifest] = []
        outcome, failure = _coordinate(
            results, ranks, lambda reports: _commit(agreed, reports, committed, name, timer, ranks, options, captured))
        if node is not None and committed and outcome is not None:  # the other nodes' leaders commit it on theirs
            outcome = {**outcome, "manifest": committed[0]}
        return _outcome(outcome, own_failure or failure, own_failure, node, url, ranks, options)


def _heed_differences(agreed: Plan, url: str, ranks: Ranks, options: SaveOptions) -> None:
    """What the plan found between the members' states: replicas whose copies differ fail the save on every
    member (``on_divergence="raise"``: every member has the plan) or are warned of by the coordinator, with
    the values that differed."""
    if agreed.divergences and options.group.refuses_divergence:
        raise CollectiveError(f"{replicas.message(agreed.divergences, url)}; nothing was committed "
                              "(on_divergence='raise')")
    if ranks.is_coordinator and agreed.differences:
        warnings.warn(_differences_message(agreed.differences), CheckpointWarning, stacklevel=5)
    if ranks.is_coordinator and agreed.divergences:
        warnings.warn(f"{replicas.message(agreed.divergences, url)}; each was stored from a rank of its majority",
                      CheckpointWarning, stacklevel=5)


def _write(agreed: Plan, node: NodeRepository | None, repo_url: str, sources: list[TensorSource],
           entries: list[PlannedTensor], timer: PhaseTimer, ranks: Ranks, options: SaveOptions,
           captured: Captured) -> dict:
    """Step 2 on this member: store the boxes the plan gave it (against the parent's where its encoding
    stores deltas), and report its chunks with its own record."""
    repo = agreed.repo or (node.open() if node is not None else Repository.open(repo_url, options.storage_options))
    assigned = agreed.assigned[ranks.position]
    mine = [sources[i] for i in assigned]
    bases = _delta_bases(repo, agreed, entries, sources, assigned, options)
    entries.clear()  # spent: the agreed plan holds what the manifest needs (100,000 tensors: 13 MiB)
    with collector_paused():
        stored = store_sources(repo, mine, options.encoding, parent_keys=agreed.parent_keys, cache=DEFAULT_CACHE,
                               timer=timer, bases=bases,
                               breaks=agreed.breaks[ranks.position] if agreed.breaks else ())
    return {"stored": stored, **rank_record(ranks.rank, timer, ranks.topology_entry(), captured)}


def _commit(agreed: Plan, reports: list[dict], committed: list[Manifest], name: str, timer: PhaseTimer,
            ranks: Ranks, options: SaveOptions, captured: Captured) -> str:
    """Step 3 on the coordinator, which holds the repository and the save lease: the manifest from every
    member's report, ``before_commit``, then the commit (kept in ``committed``); returns the checkpoint's URL."""
    repo, lease = agreed.repo, agreed.lease
    assert repo is not None and lease is not None  # run on the coordinator, which holds both
    reports[0]["timing"] = timer.record(ranks.rank, captured.steps, captured.resumes)  # with its wait
    with collector_paused():
        manifest = _manifest(agreed, reports, ranks, name, options)
    agreed.tensors.clear()  # their boxes are the manifest's shards now: freed before it is written and checked
    if options.before_commit is not None:
        options.before_commit()
    with collector_paused():
        commit_manifest(repo, manifest, lease, options.signer, options.parity)
    committed.append(manifest)
    return repo.storage.describe(name)


def _outcome(outcome: dict | None, failure: Failure | None, own_failure: Failure | None,
             node: NodeRepository | None, url: str, ranks: Ranks, options: SaveOptions) -> str:
    """The end of step 3 on every member: the coordinator's outcome, broadcast (and committed on each other
    node, by its leader); the checkpoint's URL, or the failures raised."""
    try:
        outcome = ranks.broadcast(outcome)
        if node is not None:
            node.commit(outcome, options.signer)
    except CollectiveError as exc:
        if ranks.is_coordinator and outcome is not None and "ok" in outcome:
            return outcome["ok"]  # committed; a rank went away after reporting its chunks durable
        if not ranks.is_coordinator and own_failure is None:
            raise CollectiveError(f"{exc}; the coordinator had every rank's chunks and may have committed "
                                  f"{url}: ckptfmt ls shows whether it did") from None
        raise
    _raise_failures(outcome, url, failure, ranks)
    return outcome["ok"]


class NodeRepository:
    """This member's side of a node-scoped repository (spec 9.8): each node's own storage at the same
    URL. The first member of each node other than the coordinator's (its leader) creates the node's
    repository, holds a save lease on it from the write to the node's commit, and commits there the
    manifest the coordinator committed on its own node."""

    def __init__(self, nodes: NodeLayout, ranks: Ranks, repo_url: str, options: SaveOptions):
        self.repo_url, self.options = repo_url, options
        node = nodes.node_of[ranks.position]
        self.leader = node != 0 and nodes.leaders[node] == ranks.position  # node 0 is the coordinator's
        self.repo: Repository | None = None
        self.lease: Lease | None = None

    def open(self) -> Repository:
        if self.leader:
            self.repo, self.lease = open_for_save(self.repo_url, self.options)
        else:
            self.repo = Repository.open(self.repo_url, self.options.storage_options, create=True,
                                        format_version=self.options.format_version,
                                        features=self.options.marker_features)
        return self.repo

    def commit(self, outcome: dict, signer: Any) -> None:
        """On a leader, once the coordinator has committed: the same manifest and commit record on this node.
        A failure leaves this node without the checkpoint (a restore finds it elsewhere), with a warning."""
        if not self.leader or "ok" not in outcome or self.repo is None or self.lease is None:
            return
        try:
            commit_manifest(self.repo, outcome["manifest"], self.lease, signer)
        except CheckpointError as exc:
            warnings.warn(f"{self.repo.url} on {socket.gethostname()}: the checkpoint committed by rank 0 could "
                          f"not be committed on this node ({exc})", CheckpointWarning, stacklevel=6)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None


def _with_gathered_steps(captured: Captured, options: SaveOptions, rank: int) -> Captured:
    """This rank's training steps (and resumes) from ``gathered_steps`` (frameworks that save from rank 0
    gather every rank's), unless the save was given its own."""
    mine = options.group.steps_of(rank)
    if captured.steps is not None or mine is None:
        return captured
    return dataclasses.replace(captured, steps=mine["steps"],
                               resumes=[*(captured.resumes or ()), *mine.get("resumes", ())])


def _delta_bases(repo: Repository, agreed: Plan, entries: list[PlannedTensor], sources: list[TensorSource],
                 assigned: list[int], options: SaveOptions) -> DeltaBases | None:
    """The parent's chunks this member's boxes may be stored as deltas against (``compression`` delta-zstd or
    auto): the coordinator has the parent's manifest; the others read it (the plan carries only its name)."""
    if agreed.parent_name is None or not options.encoding.stores_deltas:
        return None
    parent = agreed.parent or repo.manifest(agreed.parent_name)
    return DeltaBases.for_entries(repo, parent, entries, [s.shape for s in sources], assigned)


# -- messages between members ------------------------------------------------------------
#: What a member keeps of its own failure: the text every member is told, and the exception to chain.
Failure = tuple[str, BaseException]


def _attempt(run) -> tuple[Any, Failure | None]:
    """Run a step of this member's part; a failure is kept to be reported to every member, not raised yet."""
    try:
        return run(), None
    except CollectiveError:
        raise
    except Exception as exc:
        text = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        return None, (" ".join(text.split())[:2000], exc)


def _report(value: Any, failure: Failure | None, position: int) -> dict:
    """The message a member sends: ``{"ok": value}`` or ``{"errors": [(position, text)]}``."""
    return {"ok": value} if failure is None else {"errors": [(position, failure[0])]}


def _coordinate(reports: list[dict] | None, ranks: Ranks, step) -> tuple[dict | None, Failure | None]:
    """On the coordinator: every member's failures, or ``step`` run on their values. None elsewhere."""
    if not ranks.is_coordinator:
        return None, None
    assert reports is not None  # the coordinator gathered every member's
    errors = [error for report in reports for error in report.get("errors", ())]
    if errors:
        return {"errors": errors}, None
    value, failure = _attempt(lambda: step([report["ok"] for report in reports]))
    return _report(value, failure, ranks.position), failure


def _raise_failures(message: dict, url: str, failure: Failure | None, ranks: Ranks) -> None:
    """Raise the failures the coordinator reported: a process saving alone, its own exception; in a group,
    on every rank, one naming the rank that failed (chained to this rank's own)."""
    errors = message.get("errors")
    if not errors:
        return
    if ranks.count == 1 and failure is not None:
        raise failure[1]
    position, text = errors[0]
    more = f" (rank {', '.join(str(ranks.rank_of(p)) for p, _ in errors[1:])} failed too)" if len(errors) > 1 else ""
    error = CollectiveError(f"collective save of {url} failed, nothing was committed: "
                            f"rank {ranks.rank_of(position)}: {text}{more}")
    raise error from (failure[1] if failure else None)


def _differences_message(differences: list[str]) -> str:
    shown = "; ".join(differences[:MAX_REPORTED])
    more = f"; and {len(differences) - MAX_REPORTED} more" if len(differences) > MAX_REPORTED else ""
    return (f"ranks saved different values, the checkpoint keeps the lowest rank's: {shown}{more}; "
            "wrap values that differ by design in ckptfmt.PerRank to keep every rank's")


# -- the coordinator's manifest --------------------------------------------------------------
def _manifest(plan: Plan, reports: list[dict], ranks: Ranks, name: str, options: SaveOptions) -> Manifest:
    tables = ManifestTables()
    for report in reports:  # writer number == position
        tables.add_writer(report["stored"].chunks, report["stored"].written_rows)
    tensors: list[TensorEntry] = []
    for tensor in plan.tensors:
        if tensor.same_as is not None:  # another name of an earlier tensor: its shards (spec 6.9)
            named = tensors[tensor.same_as]
            tensors.append(tensor_entry(tensor.key, tensor.dtype, tensor.shape, [(s, None) for s in named.shards],
                                        kind=tensor.kind, requires_grad=tensor.requires_grad, same_as=tensor.same_as))
            continue
        shards = []
        for box in tensor.boxes:
            position, index = box.writer
            stored = reports[position]["stored"]
            owner = ranks.rank_of(position) if box.owner is None else box.owner
            shards.append((ShardEntry(box.offsets, box.shape, owner, tables.pieces(position, stored.pieces[index])),
                           stored.stats[index]))
        tensors.append(tensor_entry(tensor.key, tensor.dtype, tensor.shape, shards, kind=tensor.kind,
                                    requires_grad=tensor.requires_grad, same_as=tensor.same_as))
    writers = sorted({ranks.rank_of(box.writer[0]) for tensor in plan.tensors for box in tensor.boxes})
    gathered = options.group.steps_besides(ranks.rank)
    start_ns = reports[0]["timing"]["start_ns"]
    topology = topology_record([report["topology"] for report in reports], world_size=ranks.size,
                               writer_ranks=writers if ranks.collective else [ranks.rank],
                               parallelism=options.parallelism,
                               backend=ranks.backend, meshes=plan.meshes)
    manifest = manifest_for(name, options, parent=plan.parent_name, chunks=tables.chunks.chunks, tensors=tensors,
                            new_bytes=tables.chunks.new_bytes, state=plan.state, user=plan.user, records=reports,
                            topology=topology, collective=ranks.collective,
                            steps_only=[steps_record(entry, start_ns) for entry in gathered])
    if ranks.collective and options.group.compares_replicas:
        manifest.replicas = {"checked": plan.replicas_checked, "divergent": [d.record() for d in plan.divergences]}
    if plan.nodes is not None:
        manifest.placement = _placement(plan.nodes, tables, ranks)
        manifest.totals["nodes"] = len(plan.nodes.hosts)
    return manifest


def _placement(nodes: NodeLayout, tables: ManifestTables, ranks: Ranks) -> Placement:
    """Which chunk rows each node holds: those its members wrote or found stored there (spec 9.8)."""
    held: list[set[int]] = [set() for _ in nodes.hosts]
    members: list[list[int]] = [[] for _ in nodes.hosts]
    for position, node in enumerate(nodes.node_of):
        held[node].update(tables.rows(position))
        members[node].append(ranks.rank_of(position))
    return Placement(tuple(NodeChunks(host, tuple(members[index]), tuple(sorted(held[index])))
                           for index, host in enumerate(nodes.hosts)))
