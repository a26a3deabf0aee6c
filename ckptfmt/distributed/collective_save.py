"""The collective save: every rank of a process group saves its part of one checkpoint.

Protocol (spec section 11.7), with the coordinator as rank 0 of the group:

1. plan: every rank encodes its own state (tensors become sources: plain
   tensors whole, DTensors as their local shard at its offsets) and sends the
   coordinator its value tree and tensor table. The coordinator merges the value
   trees, checks that ranks agree on every tensor's dtype and shape, and gives
   each box of each tensor one writer among the ranks that hold it, balancing
   bytes (a replicated tensor is stored once; a sharded one by its owners).
2. write: every rank stores the boxes it was given, in parallel, durably, and
   reports its chunk table, RNG state, environment, topology and timing.
3. commit: once every rank has reported, the coordinator writes the manifest
   and the commit record, and tells every rank the outcome.

Any failure (an exception on a rank, a rank that never answers within the
timeout) means no commit, and a ``CollectiveError`` on every rank naming the
rank and its error. Tensor bytes never pass between ranks.
"""

from __future__ import annotations

import functools
import os
import warnings
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from ckptfmt.distributed import replicas
from ckptfmt.distributed.process_group import CollectiveError, RankGroup
from ckptfmt.distributed.state_merge import MAX_REPORTED, merge_states
from ckptfmt.errors import CheckpointError, CheckpointWarning
from ckptfmt.format.manifest import Manifest, Piece, Shard, TensorEntry
from ckptfmt.format.values import TensorRef, decode_tree, encode_tree
from ckptfmt.metadata.timing import PhaseTimer
from ckptfmt.metadata.topology import rank_entry, topology_record
from ckptfmt.repository.leases import Lease
from ckptfmt.repository.repository import Repository, split_checkpoint_url
from ckptfmt.saving.chunk_writer import ChunkTable, store_sources
from ckptfmt.saving.core import (
    Captured,
    TensorCollector,
    commit_manifest,
    manifest_for,
    merged_stats,
    open_for_save,
    rank_record,
    refuse_taken_name,
    resolve_parent,
)
from ckptfmt.saving.delta_bases import DeltaBases
from ckptfmt.saving.hashcache import DEFAULT_CACHE
from ckptfmt.saving.options import SaveOptions
from ckptfmt.saving.plan import PlannedTensor
from ckptfmt.tensors.sources import TensorSource


def collective_save(state: Any, url: str | os.PathLike, group, options: SaveOptions, captured: Captured) -> str:
    """``ckptfmt.save`` over a process group; returns the checkpoint URL."""
    url = os.fspath(url)
    timer = PhaseTimer(captured.staged)
    repo_url, name = split_checkpoint_url(url)
    with timer.phase("join"):
        try:
            ranks = RankGroup(group, options.timeout, f"collective save of {url}")
            ranks.join()
        except CollectiveError as exc:
            raise CollectiveError(
                f"{exc}. Every rank of the process group must call ckptfmt.save, each with its own state; "
                "to save this rank's state alone (the 'if rank == 0' habit), pass coordinated=False"
            ) from None

    with timer.phase("prepare"):
        sources: list[TensorSource] = []
        entries: list[PlannedTensor] = []
        collector = TensorCollector(sources, entries, collective=True, frozen=captured.frozen,
                                    stats=options.tensor_stats, device_stats=captured.device_stats)
        def prepare() -> dict:
            encoded = encode_tree(state, collector, rank=ranks.rank)
            return {"state": encoded, "entries": entries, "shapes": [s.shape for s in sources],
                    "nbytes": [s.nbytes for s in sources], "meshes": collector.meshes,
                    "fingerprints": None if options.on_divergence == "ignore" else replicas.fingerprints(sources)}
        plan, own_failure = _attempt(prepare)
    with ExitStack() as held:
        with timer.phase("plan"):  # mostly waiting for the other ranks to encode theirs
            plans = ranks.gather(_report(plan, own_failure, ranks.rank))
            decision, failure = _coordinate(plans, ranks, lambda oks: _decide(oks, repo_url, name, options))
            if decision and "ok" in decision:  # the coordinator holds the save lease until the outcome
                held.callback(decision["ok"].lease.release)
            decision = ranks.broadcast(decision)
        return _write_and_commit(decision, own_failure or failure, url, name, repo_url, sources, entries, timer,
                                 ranks, options, captured)


def _write_and_commit(decision: dict, failure: Failure | None, url: str, name: str, repo_url: str,
                      sources: list[TensorSource], entries: list[PlannedTensor], timer: PhaseTimer,
                      ranks: RankGroup, options: SaveOptions, captured: Captured) -> str:
    """Steps 2 and 3 of the protocol, once the plan is broadcast."""
    _raise_failures(decision, url, failure)
    agreed: Plan = decision["ok"]
    if agreed.divergences and options.on_divergence == "raise":  # every rank has the plan: all raise
        raise CollectiveError(f"{replicas.message(agreed.divergences, url)}; nothing was committed "
                              "(on_divergence='raise')")
    if ranks.is_coordinator and agreed.differences:
        warnings.warn(_differences_message(agreed.differences), CheckpointWarning, stacklevel=3)
    if ranks.is_coordinator and agreed.divergences:
        warnings.warn(f"{replicas.message(agreed.divergences, url)}; each was stored from a rank of its majority",
                      CheckpointWarning, stacklevel=3)

    def write() -> dict:
        repo = agreed.repo or Repository.open(repo_url, options.storage_options)
        assigned = agreed.assigned[ranks.rank]
        mine = [sources[i] for i in assigned]
        bases = _delta_bases(repo, agreed.parent_name, entries, sources, assigned, options)
        stored = store_sources(repo, mine, compression=options.compression, parent_keys=agreed.parent_keys,
                               cache=DEFAULT_CACHE, chunk_size=options.chunk_size,
                               workers=options.chunk_workers, timer=timer, stats=options.tensor_stats, bases=bases)
        return {"stored": stored, **rank_record(ranks.rank, timer, _rank_topology(ranks), captured)}
    written, own_failure = _attempt(write)
    with timer.phase("wait_ranks"):
        results = ranks.gather(_report(written, own_failure, ranks.rank))

    def commit(reports: list[dict]) -> str:
        repo, lease = agreed.repo, agreed.lease
        assert repo is not None and lease is not None  # run on the coordinator, which holds both
        reports[0]["timing"] = timer.record(ranks.rank, captured.steps)  # the coordinator's, with its wait
        manifest = _manifest(agreed, reports, ranks, name, options)
        commit_manifest(repo, manifest, lease, options.signer)
        return repo.storage.describe(name)
    outcome, failure = _coordinate(results, ranks, commit)
    try:
        outcome = ranks.broadcast(outcome)
    except CollectiveError as exc:
        if ranks.is_coordinator and outcome is not None and "ok" in outcome:
            return outcome["ok"]  # committed; a rank went away after reporting its chunks durable
        if not ranks.is_coordinator and own_failure is None:
            raise CollectiveError(f"{exc}; the coordinator had every rank's chunks and may have committed "
                                  f"{url}: ckptfmt ls shows whether it did") from None
        raise
    _raise_failures(outcome, url, own_failure or failure)
    return outcome["ok"]


def _delta_bases(repo: Repository, parent: str | None, entries: list[PlannedTensor], sources: list[TensorSource],
                 assigned: list[int], options: SaveOptions) -> DeltaBases | None:
    """The parent's chunks this rank's boxes may be stored as deltas against (``compression`` delta-zstd or
    auto): each rank reads the parent's manifest itself; the plan carries only its name."""
    if parent is None or options.compression not in ("delta-zstd", "auto"):
        return None
    return DeltaBases.for_entries(repo, repo.manifest(parent), entries, [s.shape for s in sources], assigned)


# -- messages between ranks --------------------------------------------------------------
#: What a rank keeps of its own failure: the text every rank is told, and the exception to chain.
Failure = tuple[str, BaseException]


def _attempt(run) -> tuple[Any, Failure | None]:
    """Run a step of this rank's part; a failure is kept to be reported to every rank, not raised yet."""
    try:
        return run(), None
    except CollectiveError:
        raise
    except Exception as exc:
        text = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        return None, (" ".join(text.split())[:2000], exc)


def _report(value: Any, failure: Failure | None, rank: int) -> dict:
    """The message a rank sends: ``{"ok": value}`` or ``{"errors": [(rank, text)]}``."""
    return {"ok": value} if failure is None else {"errors": [(rank, failure[0])]}


def _coordinate(reports: list[dict] | None, ranks: RankGroup, step) -> tuple[dict | None, Failure | None]:
    """On the coordinator: every rank's failures, or ``step`` run on their values. None elsewhere."""
    if not ranks.is_coordinator:
        return None, None
    assert reports is not None  # the coordinator gathered every rank's
    errors = [error for report in reports for error in report.get("errors", ())]
    if errors:
        return {"errors": errors}, None
    value, failure = _attempt(lambda: step([report["ok"] for report in reports]))
    return _report(value, failure, ranks.rank), failure


def _raise_failures(message: dict, url: str, failure: Failure | None) -> None:
    """On every rank, raise the failures the coordinator reported (chained to this rank's own)."""
    errors = message.get("errors")
    if not errors:
        return
    rank, text = errors[0]
    more = f" (rank {', '.join(str(r) for r, _ in errors[1:])} failed too)" if len(errors) > 1 else ""
    error = CollectiveError(f"collective save of {url} failed, nothing was committed: rank {rank}: {text}{more}")
    raise error from (failure[1] if failure else None)


def _differences_message(differences: list[str]) -> str:
    shown = "; ".join(differences[:MAX_REPORTED])
    more = f"; and {len(differences) - MAX_REPORTED} more" if len(differences) > MAX_REPORTED else ""
    return (f"ranks saved different values, the checkpoint keeps the lowest rank's: {shown}{more}; "
            "wrap values that differ by design in ckptfmt.PerRank to keep every rank's")


# -- the coordinator's plan ------------------------------------------------------------------
@dataclass
class _Box:
    """One box of a tensor's data, the ranks holding it (rank, source index), their fingerprints of
    it (none when not compared) and the one writing it."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int
    holders: list[tuple[int, int]]
    prints: list[bytes] = field(default_factory=list)
    writer: tuple[int, int] = (-1, -1)  # (rank, position in that rank's assigned sources)

    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The holders' ranks grouped by equal bytes, the majority first (one group when not compared)."""
        if len(self.prints) != len(self.holders):
            return (tuple(rank for rank, _ in self.holders),)
        return replicas.agreeing_groups([(rank, p) for (rank, _), p in zip(self.holders, self.prints)])


@dataclass
class _Tensor:
    key: str
    dtype: str
    shape: tuple[int, ...]
    kind: str
    requires_grad: bool
    same_as: int | None
    boxes: list[_Box] = field(default_factory=list)


@dataclass
class Plan:
    """What the coordinator decided: the value tree, the tensors, who writes what."""

    repo: Repository | None  # the coordinator's; other ranks open their own
    lease: Lease | None  # the coordinator's save lease (spec 11.6)
    parent_name: str | None
    parent_keys: set[str]
    state: bytes
    user: bytes
    tensors: list[_Tensor]
    #: Per rank, the indices of its sources it writes.
    assigned: list[list[int]]
    meshes: list[dict]
    differences: list[str]
    #: Replicated boxes whose holders' bytes differ (spec 9.7), and how many shared boxes were compared.
    divergences: list[replicas.Divergence] = field(default_factory=list)
    replicas_checked: int = 0

    def __getstate__(self) -> dict:  # what the broadcast sends: everything but the coordinator's repository
        return {**self.__dict__, "repo": None, "lease": None}


def _decide(plans: list[dict], repo_url: str, name: str, options: SaveOptions) -> Plan:
    """The coordinator's plan, made under the save lease it holds until the outcome (released on failure)."""
    repo, lease = open_for_save(repo_url, options)
    try:
        return _plan(plans, repo, lease, name, options)
    except BaseException:
        lease.release()
        raise


def _plan(plans: list[dict], repo: Repository, lease: Lease, name: str, options: SaveOptions) -> Plan:
    refuse_taken_name(repo, name)
    parent_name, parent_keys, _ = resolve_parent(repo, options.parent)
    trees = []
    for rank, plan in enumerate(plans):
        keys = [entry.key for entry in plan["entries"]]
        trees.append((rank, decode_tree(plan["state"], functools.partial(_ref, keys))))
    merged, differences = merge_states(trees)
    order: dict[str, int] = {}
    state = encode_tree(merged, lambda path, ref: order.setdefault(ref.key, len(order)))
    tensors = _tensors(plans, list(order))
    assigned = _assign(tensors, len(plans))
    meshes = [mesh for plan in plans for mesh in plan["meshes"]]
    user = encode_tree({} if options.metadata is None else options.metadata)
    shared = [(tensor, box) for tensor in tensors for box in tensor.boxes if len(box.holders) > 1 and box.prints]
    divergences = [replicas.Divergence(tensor.key, box.offsets, box.shape, groups) for tensor, box in shared
                   if len(groups := box.groups()) > 1]
    return Plan(repo, lease, parent_name, parent_keys, state, user, tensors, assigned,
                [m for i, m in enumerate(meshes) if m not in meshes[:i]], differences, divergences, len(shared))


def _ref(keys: list[str], index: int) -> TensorRef:
    """The key of a rank's tensor ``index``, as the merged value tree's leaf."""
    return TensorRef(keys[index])


def _tensors(plans: list[dict], order: list[str]) -> list[_Tensor]:
    """The tensor table in state order: each key's dtype and shape (ranks must agree) and data boxes."""
    holding: dict[str, list[tuple[int, PlannedTensor]]] = {}
    for rank, plan in enumerate(plans):
        for entry in plan["entries"]:
            holding.setdefault(entry.key, []).append((rank, entry))
    disagreements = []
    for key in order:
        first_rank, first = holding[key][0]
        for rank, entry in holding[key][1:]:
            if (entry.dtype, tuple(entry.shape)) != (first.dtype, tuple(first.shape)):
                disagreements.append(f"{key!r} is {first.dtype} {list(first.shape)} on rank {first_rank}, "
                                     f"{entry.dtype} {list(entry.shape)} on rank {rank}")
                break
    if disagreements:
        raise CheckpointError(f"ranks disagree on {len(disagreements)} tensor(s): " + "; ".join(disagreements[:8]))

    def data_key(key: str) -> str:
        """The key whose boxes hold this tensor's data: an alias (same_as) on its first rank points elsewhere."""
        rank, entry = holding[key][0]
        return key if entry.same_as is None else plans[rank]["entries"][entry.same_as].key

    tensors: list[_Tensor] = []
    primary: dict[str, int] = {}
    for key in order:
        rank, entry = holding[key][0]
        source_key = data_key(key)
        alias_of = primary.get(source_key)
        tensor = _Tensor(key, entry.dtype, tuple(entry.shape), entry.kind, entry.requires_grad, alias_of)
        if alias_of is None:
            primary[source_key] = len(tensors)
            tensor.boxes = _boxes(plans, holding[source_key], key)
        tensors.append(tensor)
    return tensors


def _boxes(plans: list[dict], holders: list[tuple[int, PlannedTensor]], key: str) -> list[_Box]:
    boxes: dict[tuple[int, ...], _Box] = {}
    for rank, entry in holders:
        if entry.same_as is not None:
            continue
        prints = plans[rank]["fingerprints"]
        for held in entry.boxes:
            source, offsets = held.source, held.offsets
            shape = tuple(plans[rank]["shapes"][source])
            box = boxes.setdefault(tuple(offsets), _Box(tuple(offsets), shape, plans[rank]["nbytes"][source], []))
            if box.shape != shape:
                raise CheckpointError(f"tensor {key!r}: ranks hold boxes at offsets {list(offsets)} of different "
                                      f"shapes ({list(box.shape)} and {list(shape)})")
            box.holders.append((rank, source))
            if prints is not None:
                box.prints.append(prints[source])
    return [boxes[offsets] for offsets in sorted(boxes)]


def _assign(tensors: list[_Tensor], world: int) -> list[list[int]]:
    """One writer per box: boxes only one rank holds go to it; shared ones, largest first, to the least loaded."""
    load = [0] * world
    assigned: list[list[int]] = [[] for _ in range(world)]
    boxes = [box for tensor in tensors for box in tensor.boxes]

    def give(box: _Box, rank: int, source: int) -> None:
        box.writer = (rank, len(assigned[rank]))
        assigned[rank].append(source)
        load[rank] += box.nbytes
    for box in boxes:
        if len(box.holders) == 1:
            give(box, *box.holders[0])
    for box in sorted((b for b in boxes if len(b.holders) > 1), key=lambda b: -b.nbytes):
        majority = set(box.groups()[0])  # the holders whose copies agree with most others'
        rank, source = min((h for h in box.holders if h[0] in majority), key=lambda h: (load[h[0]], h[0]))
        give(box, rank, source)
    return assigned


# -- the coordinator's manifest --------------------------------------------------------------
def _manifest(plan: Plan, reports: list[dict], ranks: RankGroup, name: str, options: SaveOptions) -> Manifest:
    table = ChunkTable()
    rows = [[table.add_with_bases(chunk, stored.chunks, index in stored.written_rows)
             for index, chunk in enumerate(stored.chunks)]
            for stored in (report["stored"] for report in reports)]  # a delta's base: a row of its rank's table
    tensors = []
    for tensor in plan.tensors:
        shards, stats = [], []
        for box in tensor.boxes:
            rank, position = box.writer
            stored = reports[rank]["stored"]
            pieces = tuple(Piece(rows[rank][p.chunk], p.offset, p.length) for p in stored.pieces[position])
            shards.append(Shard(box.offsets, box.shape, rank, pieces))
            stats.append(stored.stats[position])
        tensors.append(TensorEntry(key=tensor.key, dtype=tensor.dtype, shape=tensor.shape, shards=tuple(shards),
                                   kind=tensor.kind, requires_grad=tensor.requires_grad, same_as=tensor.same_as,
                                   stats=merged_stats(stats) if tensor.same_as is None else None))
    writers = sorted({box.writer[0] for tensor in plan.tensors for box in tensor.boxes})
    topology = topology_record([report["topology"] for report in reports], world_size=ranks.size,
                               writer_ranks=writers, parallelism=options.parallelism, backend=ranks.backend,
                               meshes=plan.meshes)
    manifest = manifest_for(name, options, parent=plan.parent_name, chunks=table.chunks, tensors=tensors,
                            new_bytes=table.new_bytes, state=plan.state, user=plan.user, records=reports,
                            topology=topology, collective=True)
    if options.on_divergence != "ignore":
        manifest.replicas = {"checked": plan.replicas_checked, "divergent": [d.record() for d in plan.divergences]}
    return manifest


def _rank_topology(ranks: RankGroup) -> dict:
    return {**rank_entry(ranks.rank), "global_rank": ranks.global_ranks[ranks.rank]}
