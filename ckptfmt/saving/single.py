"""The single-process save: this process's state, encoded, chunked and committed by this process alone."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ckptfmt.format.manifest import Piece, Shard, TensorEntry
from ckptfmt.format.values import encode_tree
from ckptfmt.metadata.timing import PhaseTimer
from ckptfmt.metadata.topology import current_rank, rank_entry, topology_record
from ckptfmt.repository.leases import Lease
from ckptfmt.repository.repository import Repository, split_checkpoint_url
from ckptfmt.saving.chunk_writer import store_sources
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
    steps_record,
)
from ckptfmt.saving.delta_bases import DeltaBases
from ckptfmt.saving.hashcache import DEFAULT_CACHE
from ckptfmt.saving.options import SaveOptions
from ckptfmt.saving.plan import PlannedTensor
from ckptfmt.tensors.sources import TensorSource


def save_single(state: Any, url: str | os.PathLike, options: SaveOptions, captured: Captured) -> str:
    """Save ``state`` as checkpoint ``url`` from this process alone; returns the checkpoint's URL."""
    repo_url, name = split_checkpoint_url(url)
    timer = PhaseTimer(captured.staged)
    with timer.phase("lease"):
        repo, lease = open_for_save(repo_url, options)
    try:
        return _save_leased(repo, name, state, timer, lease, options, captured)
    finally:
        lease.release()


def _save_leased(repo: Repository, name: str, state: Any, timer: PhaseTimer, lease: Lease, options: SaveOptions,
                 captured: Captured) -> str:
    """From the name check to the commit, under the save lease."""
    rank, world_size = current_rank()
    with timer.phase("prepare"):
        refuse_taken_name(repo, name)
        parent_name, parent_keys, parent = resolve_parent(repo, options.parent)
        sources: list[TensorSource] = []
        entries: list[PlannedTensor] = []
        collector = TensorCollector(sources, entries, frozen=captured.frozen, stats=options.tensor_stats,
                                    device_stats=captured.device_stats)
        state_bytes = encode_tree(state, collector, rank=rank)
        user_bytes = encode_tree({} if options.metadata is None else options.metadata, None)
        bases = DeltaBases.for_entries(repo, parent, entries, [s.shape for s in sources]) if (
            parent is not None and options.compression in ("delta-zstd", "auto")) else None
    stored = store_sources(repo, sources, compression=options.compression, parent_keys=parent_keys,
                           cache=DEFAULT_CACHE, chunk_size=options.chunk_size,
                           workers=options.chunk_workers, timer=timer, stats=options.tensor_stats, bases=bases)
    gathered = {entry["rank"]: entry for entry in options.gathered_steps or ()}
    if captured.steps is None and rank in gathered:  # this rank's steps came with the others'
        captured = dataclasses.replace(captured, steps=gathered[rank]["steps"])
    record = rank_record(rank, timer, rank_entry(rank), captured)
    tensors = tensor_table(entries, [s.shape for s in sources], stored.pieces, rank, stored.stats)
    manifest = manifest_for(
        name, options, parent=parent_name, chunks=stored.chunks, tensors=tensors, new_bytes=stored.new_bytes,
        state=state_bytes, user=user_bytes, records=[record], collective=False,
        steps_only=[steps_record(entry, record["timing"]["start_ns"]) for r, entry in sorted(gathered.items())
                    if r != rank],
        topology=topology_record([record["topology"]], world_size=world_size, writer_ranks=[rank],
                                 parallelism=options.parallelism),
    )
    if options.before_commit is not None:
        options.before_commit()
    commit_manifest(repo, manifest, lease, options.signer)
    return repo.storage.describe(name)


def tensor_table(entries: list[PlannedTensor], shapes: list[tuple[int, ...]], pieces: list[tuple[Piece, ...]],
                 rank: int, stats: list[dict | None]) -> list[TensorEntry]:
    """The manifest's tensor table: each entry's shards, with the pieces of the sources they came
    from, and its statistics merged from theirs (none on a ``same_as`` entry)."""
    return [
        TensorEntry(
            key=entry.key, dtype=entry.dtype, shape=entry.shape, kind=entry.kind,
            requires_grad=entry.requires_grad, same_as=entry.same_as,
            shards=tuple(
                Shard(offsets=box.offsets, shape=shapes[box.source], rank=rank if box.owner is None else box.owner,
                      pieces=pieces[box.source])
                for box in entry.boxes
            ),
            stats=None if entry.same_as is not None else merged_stats([stats[box.source] for box in entry.boxes]),
        )
        for entry in entries
    ]
