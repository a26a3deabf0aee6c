"""save(): write a training state as a new checkpoint, durably and atomically.

Order of writes (the commit protocol of spec/FORMAT.md): every chunk, then the
manifest, then the commit record, each durable before the next starts. A save
that dies at any point leaves earlier checkpoints untouched and its own
invisible: readers only see names with a commit record.
"""

from __future__ import annotations

import operator
import os
import time
import warnings
from typing import Any, Callable

import msgpack
import torch

from ckptfmt.format import codecs, layout
from ckptfmt.saving import in_flight
from ckptfmt.metadata.environment import capture_environment
from ckptfmt.errors import (
    CheckpointError, CheckpointExistsError, CheckpointNotFoundError, CheckpointWarning, ManifestError,
    UnsupportedValueError,
)
from ckptfmt.saving.hashcache import DEFAULT_CACHE
from ckptfmt.saving.chunk_writer import checkpoint_stats, store_sources
from ckptfmt.distributed.collective_save import collective_save
from ckptfmt.distributed.dtensors import is_dtensor, local_shard
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.repository.leases import Lease, hold_save_lease
from ckptfmt.format.limits import MAX_CHUNK_BYTES, MAX_KEY_BYTES, check_name
from ckptfmt.format.manifest import MAX_RANK, Manifest, Piece, Shard, TensorEntry
from ckptfmt.format.tiling import check_tiling
from ckptfmt.repository.repository import CommitRecord, Repository, split_checkpoint_url
from ckptfmt.distributed.process_group import distributed_group
from ckptfmt.metadata.rng import rng_entry
from ckptfmt.format.sharded import LocalShard, Shard as ShardInput, Sharded
from ckptfmt.format.tensors import TensorSource, prepare
from ckptfmt.metadata.step_timer import StepTimer
from ckptfmt.metadata.timing import PhaseTimer
from ckptfmt.metadata.topology import capture_topology, current_rank
from ckptfmt.format.values import encode_tree, format_key

_LATEST = object()
#: How long a collective save waits for every rank at each of its steps.
DEFAULT_TIMEOUT_S = 600.0


def save(
    state: Any,
    url: str | os.PathLike,
    *,
    step: int | None = None,
    metadata: dict | None = None,
    storage_options: dict | None = None,
    parent: Any = _LATEST,
    chunk_size: int | None = None,
    compression: str | None = None,
    step_times: list | None = None,
    parallelism: dict | None = None,
    workers: int | None = None,
    rng: list[dict] | None = None,
    provenance: dict | None = None,
    before_commit: Callable[[], None] | None = None,
    process_group: Any = None,
    coordinated: bool | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    timer: StepTimer | None = None,
) -> str:
    """Save ``state`` (nested dicts/lists/tuples of tensors and plain values) as checkpoint ``url``.

    ``url`` is ``REPO/NAME``: the repository is created when missing and NAME
    must be new. Returns the checkpoint's URL. Durable when it returns.

    ``parent`` defaults to the repository's latest checkpoint (None for none);
    ``compression`` is None, 'zstd' or 'shuffle-zstd'; ``step_times`` are the
    caller's per-step timings, stored under ``timing``; ``parallelism`` records
    the run's layout (e.g. ``{"dp": 8, "tp": 2}``). Converters pass ``rng``
    (entries recorded by another tool, replacing this process's states) and
    ``provenance`` (where an imported checkpoint came from).

    ``before_commit`` is called once every chunk is durable, just before the
    manifest and commit record are written; if it raises, the save stops there
    and the exception propagates, leaving no checkpoint (only orphan chunks,
    spec 11.6). Converters use it to finish checking their source while the
    chunks are written, instead of before.

    Under torch.distributed (a default process group of more than one process,
    or ``process_group``) the save is collective, like
    ``torch.distributed.checkpoint.save``: every rank calls it with its own
    state and one checkpoint holds them all (replicated values stored once,
    DTensors as their shards, ``ckptfmt.PerRank`` values per rank). It fails
    on every rank, committing nothing, if any rank fails or does not answer
    within ``timeout`` seconds. ``coordinated=False`` saves this process's
    state alone, as a single-process save.

    ``timer`` (a ``ckptfmt.StepTimer``): its steps not yet in a checkpoint are
    stored with this one, every rank's (spec 9.4), and leave the timer once it
    is committed.

    An asynchronous save of the same repository still running in this process
    is waited for first (its error, if it failed, is raised here).
    """
    options = dict(locals())
    del options["state"], options["url"], options["timer"]
    in_flight.wait_for_previous(url)
    steps = step_records(timer)
    committed = save_state(state, url, frozen=False, steps=steps, **options)
    if timer is not None:
        timer.forget(steps["count"])
    return committed


def step_records(timer: StepTimer | None) -> dict | None:
    """The timer's steps not yet stored (a copy), or None without a timer."""
    if timer is None:
        return None
    if not isinstance(timer, StepTimer):
        raise TypeError(f"timer must be a ckptfmt.StepTimer, not {type(timer).__name__}")
    return timer.snapshot()


def save_state(state: Any, url: str | os.PathLike, *, frozen: bool, step, metadata, storage_options, parent,
               chunk_size, compression, step_times, parallelism, workers, rng, provenance, before_commit,
               process_group, coordinated, timeout, steps: dict | None, staged: tuple[int, float] | None = None,
               captured_rng: dict | None = None) -> str:
    """``save``'s work; ``frozen``: the state is staged memory that nothing changes until this returns;
    ``steps``: this rank's step records (``StepTimer.snapshot``) or None; ``staged``: when and how
    long an asynchronous save's staging took (its ``stage`` phase); ``captured_rng``: this process's
    RNG states when an asynchronous save was called (``capture_states``)."""
    step = check_arguments(step, chunk_size, compression, step_times, parallelism, rng, provenance)
    if before_commit is not None and not callable(before_commit):
        raise TypeError("before_commit must be a callable or None")
    group = None if coordinated is False else distributed_group(process_group)
    if group is None and coordinated:
        raise ValueError("coordinated=True needs an initialised torch.distributed process group")
    if group is not None:
        if before_commit is not None:
            raise ValueError("before_commit is for single-process saves")
        if not timeout > 0:
            raise ValueError("timeout must be a positive number of seconds")
        return collective_save(
            state, url, group, timeout=timeout, step=step, metadata=metadata, storage_options=storage_options,
            parent=parent, chunk_size=chunk_size, compression=compression, step_times=step_times,
            parallelism=parallelism, workers=workers, rng=rng, provenance=provenance, frozen=frozen, steps=steps,
            staged=staged, captured_rng=captured_rng,
        )
    repo_url, name = split_checkpoint_url(url)
    timer = PhaseTimer(staged)
    with timer.phase("lease"):  # the repository, and the lease that keeps a garbage collector away (spec 11.6)
        repo = Repository.open(repo_url, storage_options, create=True)
        lease = hold_save_lease(repo)
    try:
        return _save_leased(repo, name, state, timer, lease, frozen=frozen, step=step, metadata=metadata,
                            parent=parent, chunk_size=chunk_size, compression=compression, step_times=step_times,
                            parallelism=parallelism, workers=workers, rng=rng, provenance=provenance,
                            before_commit=before_commit, steps=steps, captured_rng=captured_rng)
    finally:
        lease.release()


def _save_leased(repo: Repository, name: str, state: Any, timer: PhaseTimer, lease: Lease, *, frozen: bool, step,
                 metadata, parent, chunk_size, compression, step_times, parallelism, workers, rng, provenance,
                 before_commit, steps, captured_rng) -> str:
    """A single-process save, from the name check to the commit, under its save lease."""
    rank, _ = current_rank()
    with timer.phase("prepare"):
        if repo.storage.exists(layout.commit_key(name)):
            raise CheckpointExistsError(f"{repo.storage.describe(name)}: checkpoint already exists")
        parent_name, parent_keys = resolve_parent(repo, parent)
        sources: list[TensorSource] = []
        entries: list[dict] = []
        state_bytes = encode_tree(state, TensorCollector(sources, entries, frozen=frozen), rank=rank)
        user_bytes = encode_tree({} if metadata is None else metadata, None)
        rng_entries = rng if rng is not None else [rng_entry(rank, captured_rng)]
    # 4 writers overlap hashing with other chunks' writes and fsyncs; on remote
    # storage each holds a copy of its chunk, so 4 x 64 MiB bounds the memory.
    stored = store_sources(repo, sources, compression=compression, parent_keys=parent_keys, cache=DEFAULT_CACHE,
                           chunk_size=chunk_size, workers=workers or 4, timer=timer)
    with timer.phase("environment"):
        environment = capture_environment()
    tensors = tensor_table(entries, [s.shape for s in sources], stored.pieces, rank)
    manifest = Manifest(
        name=name, step=step, created_ns=time.time_ns(), parent=parent_name,
        chunks=stored.chunks, tensors=tensors, state=state_bytes, user=user_bytes, rng=rng_entries,
        environment=environment, topology=capture_topology(parallelism),
        timing={"ranks": [timer.record(rank, steps)], "steps": list(step_times or [])},
        stats=checkpoint_stats(tensors, stored.chunks, stored.new_bytes), provenance=provenance,
    )
    if before_commit is not None:
        before_commit()
    commit_manifest(repo, manifest, lease)
    return repo.storage.describe(name)


def check_arguments(step, chunk_size, compression, step_times, parallelism, rng, provenance) -> int | None:
    """Refuse bad arguments before anything is written; returns ``step`` as a plain int."""
    if step is not None:
        if isinstance(step, bool) or not hasattr(step, "__index__"):
            raise TypeError(f"step must be an integer or None, not {type(step).__name__}")
        step = operator.index(step)  # numpy and 0-d integer tensors too
    if chunk_size is not None and not 4096 <= chunk_size <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_size must be between 4096 and {MAX_CHUNK_BYTES} bytes")
    codecs.codec_for(compression, 4)
    if rng is not None and not (isinstance(rng, list) and all(isinstance(e, dict) for e in rng)):
        raise TypeError("rng must be a list of per-rank dicts")
    for name, value in (("step_times", step_times), ("parallelism", parallelism), ("rng", rng),
                        ("provenance", provenance)):
        try:
            msgpack.packb(value, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise UnsupportedValueError(f"{name} must hold plain values (numbers, strings, lists, dicts): {exc}") from None
    return step


class TensorCollector:
    """The value tree's tensor hook: prepares each leaf and numbers it (same object, same entry).

    In a collective save (``collective``), a DTensor becomes its local shard, at its offsets in
    the global tensor; the meshes met are kept in ``meshes``. ``frozen``: the state is staged
    memory (an asynchronous save's) that stays unchanged until the save ends.
    """

    def __init__(self, sources: list[TensorSource], entries: list[dict], *, collective: bool = False,
                 frozen: bool = False):
        self.sources = sources
        self.entries = entries
        self.collective = collective
        self.frozen = frozen
        self.meshes: list[dict] = []
        self.seen: dict[int, int] = {}
        self.keys: set[str] = set()

    def __call__(self, path: tuple, value) -> int:
        key = format_key(path)
        if not path:
            raise UnsupportedValueError("a tensor at the root of the state has no key: save {'tensor': t} instead")
        if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
            raise UnsupportedValueError(f"tensor key {key[:80]!r}... is longer than {MAX_KEY_BYTES} bytes")
        if key in self.keys:
            raise UnsupportedValueError(f"two tensors map to the key {key!r}; rename one of the dict keys")
        self.keys.add(key)
        index = len(self.entries)
        first = self.seen.get(id(value))
        if first is not None:
            self.entries.append({**self.entries[first], "key": key, "same_as": first})
            return index
        self.seen[id(value)] = index
        where = "state" + "".join(f"[{p!r}]" for p in path)
        if type(value) is Sharded:
            self.entries.append(self._sharded(key, value, where))
            return index
        if is_dtensor(value) or type(value) is LocalShard:
            self.entries.append(self._dtensor(key, value, where))
            return index
        source = self._source(value, where)
        self.entries.append({
            "key": key, "same_as": None, "dtype": source.dtype, "shape": source.shape, "kind": source.kind,
            "requires_grad": source.requires_grad, "shards": [(len(self.sources) - 1, (0,) * len(source.shape), None)],
        })
        return index

    def _dtensor(self, key: str, value, where: str) -> dict:
        """An entry for this rank's shard of a DTensor, or of a staged one (the other ranks add theirs)."""
        if not self.collective:
            raise UnsupportedValueError(
                f"{where}: a DTensor is saved by a collective save: call ckptfmt.save on every rank of its "
                "process group (a save with coordinated=False stores plain tensors only)"
            )
        shard = value if type(value) is LocalShard else local_shard(value, where)
        if shard.mesh not in self.meshes:
            self.meshes.append(shard.mesh)
        source = self._source(shard.tensor, where)
        return {"key": key, "same_as": None, "dtype": source.dtype, "shape": shard.global_shape,
                "kind": shard.kind, "requires_grad": shard.requires_grad,
                "shards": [(len(self.sources) - 1, shard.offsets, None)]}

    def _source(self, value, where: str) -> TensorSource:
        """A new source for ``value`` (frozen: staged memory that nothing changes during the save)."""
        source = prepare(value, where)
        source.frozen = self.frozen and source.borrowed
        self.sources.append(source)
        return source

    def _sharded(self, key: str, value: Sharded, where: str) -> dict:
        """An entry whose shards are separate sources; refuses layouts readers would refuse."""
        if not value.shards:
            raise UnsupportedValueError(f"{where}: a sharded tensor needs at least one shard")
        shards, dtypes = [], set()
        for shard in value.shards:
            if not isinstance(shard, ShardInput) or not isinstance(shard.tensor, torch.Tensor):
                raise UnsupportedValueError(f"{where}: shards must be ckptfmt.Shard(offsets, tensor, rank)")
            source = self._source(shard.tensor, where)
            dtypes.add(source.dtype)
            shards.append((len(self.sources) - 1, tuple(int(o) for o in shard.offsets), _shard_rank(shard, where)))
        if len(dtypes) != 1:
            raise UnsupportedValueError(f"{where}: shards have different dtypes {sorted(dtypes)}")
        boxes = tuple(Shard(offsets, self.sources[src].shape, rank, ()) for src, offsets, rank in shards)
        try:
            if any(len(b.offsets) != len(value.shape) or len(b.shape) != len(value.shape) or
                   any(o + n > d for o, n, d in zip(b.offsets, b.shape, value.shape)) for b in boxes):
                raise ManifestError(f"{where}: a shard lies outside the global shape {list(value.shape)}")
            check_tiling(where, value.shape, boxes)
        except ManifestError as exc:
            raise UnsupportedValueError(str(exc)) from None
        return {"key": key, "same_as": None, "dtype": dtypes.pop(), "shape": value.shape, "kind": "tensor",
                "requires_grad": False, "shards": shards}


def _shard_rank(shard: ShardInput, where: str) -> int:
    """A shard's owning rank (spec 6.5): an integer in [0, MAX_RANK], refused before anything is written."""
    rank = shard.rank
    if isinstance(rank, bool) or not hasattr(rank, "__index__") or not 0 <= operator.index(rank) <= MAX_RANK:
        raise UnsupportedValueError(f"{where}: a shard's rank must be an integer in [0, {MAX_RANK}], not {rank!r}")
    return operator.index(rank)


def resolve_parent(repo: Repository, parent: Any) -> tuple[str | None, set[str]]:
    """The parent's name, and the keys of its chunks: committed, hence present and durable."""
    if parent is None:
        return None, set()
    if parent is _LATEST:
        latest = repo.latest_record()  # through the commit index: a few requests whatever the repository holds
        if latest is None:
            return None, set()
        parent = latest.name
        try:
            manifest = repo.manifest(parent, latest)
        except CheckpointError as exc:  # a damaged latest checkpoint must not block new saves
            warnings.warn(f"not using {parent!r} as parent: {exc}", stacklevel=3, category=CheckpointWarning)
            return None, set()
    else:
        try:
            manifest = repo.manifest(check_name(parent))
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"parent checkpoint {parent!r} not found in {repo.url}") from None
    return parent, {layout.chunk_key(c.hash, c.codec) for c in manifest.chunks}


def tensor_table(entries: list[dict], shapes: list[tuple[int, ...]], pieces: list[tuple[Piece, ...]],
                 rank: int) -> list[TensorEntry]:
    """The manifest's tensor table: each entry's shards, with the pieces of the sources they came from."""
    return [
        TensorEntry(
            key=entry["key"], dtype=entry["dtype"], shape=entry["shape"], kind=entry["kind"],
            requires_grad=entry["requires_grad"], same_as=entry["same_as"],
            shards=tuple(
                Shard(offsets=offsets, shape=shapes[src], rank=rank if shard_rank is None else shard_rank,
                      pieces=pieces[src])
                for src, offsets, shard_rank in entry["shards"]
            ),
        )
        for entry in entries
    ]


def commit_manifest(repo: Repository, manifest: Manifest, lease: Lease) -> None:
    """Write the manifest, then the commit record that makes the checkpoint exist, unless the save's
    lease has run out (a collector may have swept a chunk it reuses)."""
    data = manifest.to_bytes()
    Manifest.from_bytes(data, repo.storage.describe(manifest.name))  # never commit what readers refuse
    digest = chunk_hash(data)
    key = layout.manifest_key(manifest.name, digest)
    repo.storage.write(key, data, durable=False)  # one fsync, the sync's, with its folder's
    repo.storage.sync([key])
    record = CommitRecord(
        name=manifest.name, manifest_hash=digest, manifest_size=len(data), step=manifest.step,
        created_ns=manifest.created_ns, parent=manifest.parent, stats=manifest.stats,
    )
    lease.check("writing the commit record")
    repo.create_commit(record)


__all__ = ["save"]
