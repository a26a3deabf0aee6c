"""The parts of a save that the save pipeline (saving/pipeline.py, for every
save by one process or many) and the DCP storage writer (distributed/dcp.py,
whose planning is DCP's) share:

- ``TensorCollector``: the value tree's tensor hook, turning leaves into sources;
- ``open_for_save`` / ``refuse_taken_name`` / ``resolve_parent``: the repository,
  its save lease (spec 11.6), the new name, the parent's chunks;
- ``rank_record``: one record per rank (RNG, environment, topology entry, timing);
- ``merged_stats``: a tensor's statistics from its shards';
- ``manifest_for``: the manifest from the tensor table and every rank's record;
- ``commit_manifest``: the manifest, then the commit record (spec 11.1).

Order of writes (the commit protocol): every chunk, then the manifest, then the
commit record, each durable before the next starts. A save that dies at any
point leaves earlier checkpoints untouched and its own invisible: readers only
see names with a commit record.
"""

from __future__ import annotations

import math
import operator
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptfmt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWarning,
    ManifestError,
    UnsupportedValueError,
)
from ckptfmt.format import layout
from ckptfmt.format.chunk_table import stored_key
from ckptfmt.format.features import refuse_unless_writable
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.format.limits import MAX_DIMS, MAX_KEY_BYTES, check_name
from ckptfmt.format.manifest import MAX_RANK, Chunk, Manifest, ShardEntry, TensorEntry, TensorTable
from ckptfmt.format.signatures import SigningKey
from ckptfmt.format.tensor_stats import merge_stats
from ckptfmt.format.tiling import check_tiling
from ckptfmt.format.values import format_key, state_path, uses_per_rank
from ckptfmt.metadata.environment import capture_environment, merge_environments
from ckptfmt.metadata.rng import rng_entry
from ckptfmt.metadata.timing import PhaseTimer, with_steps
from ckptfmt.repository.leases import Lease, hold_save_lease
from ckptfmt.repository.protecting import finish_protection, protect_checkpoint
from ckptfmt.repository.protection import parse_parity
from ckptfmt.repository.repository import CommitRecord, Repository
from ckptfmt.repository.signatures import write_signature
from ckptfmt.saving.chunk_writer import checkpoint_totals
from ckptfmt.saving.options import LATEST, SaveOptions
from ckptfmt.saving.plan import PlannedTensor, SourceBox
from ckptfmt.saving.staging import memory_key
from ckptfmt.tensors.dtensors import is_dtensor, local_shard
from ckptfmt.tensors.sharded import LocalShard, Shard, Sharded
from ckptfmt.tensors.sources import TensorSource, prepare
from ckptfmt.tensors.stats import PendingStats


@dataclass(frozen=True)
class Captured:
    """What a save call captured when it was made, for a save that may run later (``async_save``).

    ``steps``: the StepTimer's step records not yet stored (``StepTimer.snapshot``), or None;
    ``rng``: this process's generator states at the call (``capture_states``), or None for the
    states when the record is made; ``staged``: (start_ns, duration_s) of the staging copy, the
    save's ``stage`` phase; ``frozen``: the state is staged memory that nothing changes until the
    save ends; ``device_stats``: staged tensor (``staging.memory_key``) -> its statistics, taken
    on its CUDA device while it was staged.
    """

    steps: dict | None = None
    rng: dict | None = None
    #: This process's resumes not yet stored (``metadata.resumes``), put in its rank's timing entry.
    resumes: list[dict] | None = None
    staged: tuple[int, float] | None = None
    frozen: bool = False
    device_stats: dict[tuple, dict] | None = None


#: The offsets of a whole tensor's box, by its number of dimensions.
_ORIGINS = [(0,) * ndim for ndim in range(MAX_DIMS + 1)]


class TensorCollector:
    """The value tree's tensor hook: prepares each leaf and numbers it (same object, same entry).

    In a collective save (``collective``), a DTensor becomes its local shard, at its offsets in
    the global tensor; the meshes met are kept in ``meshes``. ``frozen``: the state is staged
    memory (an asynchronous save's) that stays unchanged until the save ends. ``tensor_stats``: tensors
    on a device other than the CPU get their statistics (spec 6.10) reduced there before their
    bytes are copied to the host; ``device_stats`` gives those of staged tensors, taken on their
    device when they were staged (by ``staging.memory_key``).
    """

    def __init__(self, sources: list[TensorSource], entries: list[PlannedTensor], *, collective: bool = False,
                 frozen: bool = False, tensor_stats: bool = True, device_stats: dict[tuple, dict] | None = None):
        self.sources = sources
        self.entries = entries
        self.collective = collective
        self.frozen = frozen
        self.tensor_stats = tensor_stats
        self.device_stats = device_stats or {}
        self.meshes: list[dict] = []
        self.seen: dict[int, int] = {}
        self.keys: set[str] = set()

    def __call__(self, path: tuple, value) -> int:
        key = format_key(path)
        if not path:
            raise UnsupportedValueError("a tensor at the root of the state has no key: save {'tensor': t} instead")
        if len(key) > MAX_KEY_BYTES // 4 and len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
            raise UnsupportedValueError(f"tensor key {key[:80]!r}... is longer than {MAX_KEY_BYTES} bytes")
        if key in self.keys:
            raise UnsupportedValueError(f"two tensors map to the key {key!r}; rename one of the dict keys")
        self.keys.add(key)
        index = len(self.entries)
        first = self.seen.get(id(value))
        if first is not None:
            self.entries.append(self.entries[first].alias(key, first))
            return index
        self.seen[id(value)] = index
        where = _Where(path)
        kind = type(value)
        if kind is not torch.Tensor and kind is not torch.nn.Parameter:  # a plain tensor is neither below
            if kind is Sharded:
                self.entries.append(self._sharded(key, value, where))
                return index
            if is_dtensor(value) or kind is LocalShard:
                self.entries.append(self._dtensor(key, value, where))
                return index
        source = self._source(value, where)
        self.entries.append(PlannedTensor(key, source.dtype, source.shape, source.kind, source.requires_grad,
                                          (SourceBox(len(self.sources) - 1, _ORIGINS[len(source.shape)]),)))
        return index

    def forget(self) -> None:
        """Let go of what only the encoding needs (the keys and objects met), once the tree is encoded."""
        self.seen.clear()
        self.keys.clear()

    def _dtensor(self, key: str, value, where: _Where) -> PlannedTensor:
        """An entry for this rank's shard of a DTensor, or of a staged one (the other ranks add theirs).

        A process saving alone holds every shard only where the mesh is this one process (a job of
        one rank, as torchtitan or FSDP2 run on one GPU): such a DTensor is saved, any other refused."""
        shard = value if type(value) is LocalShard else local_shard(value, str(where))
        if not self.collective and math.prod(shard.mesh["shape"]) != 1:
            raise UnsupportedValueError(
                f"{where}: a DTensor is saved by a collective save: call ckptfmt.save on every rank of its "
                "process group (a save with coordinated=False stores plain tensors only)"
            )
        if shard.mesh not in self.meshes:
            self.meshes.append(shard.mesh)
        source = self._source(shard.tensor, where)
        return PlannedTensor(key, source.dtype, tuple(shard.global_shape), shard.kind, shard.requires_grad,
                             (SourceBox(len(self.sources) - 1, tuple(shard.offsets)),))

    def _source(self, value, where: _Where) -> TensorSource:
        """A new source for ``value`` (frozen: staged memory that nothing changes during the save),
        with its statistics when they are taken before its bytes reach the host."""
        on_device = (self.tensor_stats and isinstance(value, torch.Tensor) and not value.is_cpu
                     and not value.is_meta)
        pending = PendingStats(value) if on_device else None
        source = prepare(value, where)
        source.frozen = self.frozen and source.borrowed
        if pending is not None:
            source.stats = pending.result()
        elif self.tensor_stats and self.device_stats and isinstance(value, torch.Tensor):
            source.stats = self.device_stats.get(memory_key(value))
        self.sources.append(source)
        return source

    def _sharded(self, key: str, value: Sharded, where: _Where) -> PlannedTensor:
        """An entry whose shards are separate sources; refuses layouts readers would refuse."""
        if not value.shards:
            raise UnsupportedValueError(f"{where}: a sharded tensor needs at least one shard")
        shards, dtypes = [], set()
        for shard in value.shards:
            if not isinstance(shard, Shard) or not isinstance(shard.tensor, torch.Tensor):
                raise UnsupportedValueError(f"{where}: shards must be ckptfmt.Shard(offsets, tensor, rank)")
            source = self._source(shard.tensor, where)
            dtypes.add(source.dtype)
            shards.append(SourceBox(len(self.sources) - 1, tuple(int(o) for o in shard.offsets),
                                    _shard_rank(shard, where)))
        if len(dtypes) != 1:
            raise UnsupportedValueError(f"{where}: shards have different dtypes {sorted(dtypes)}")
        boxes = tuple(ShardEntry(b.offsets, self.sources[b.source].shape, b.owner or 0, ()) for b in shards)
        try:
            if any(len(b.offsets) != len(value.shape) or len(b.shape) != len(value.shape) or
                   any(o + n > d for o, n, d in zip(b.offsets, b.shape, value.shape)) for b in boxes):
                raise ManifestError(f"{where}: a shard lies outside the global shape {list(value.shape)}")
            check_tiling(str(where), value.shape, boxes)
        except ManifestError as exc:
            raise UnsupportedValueError(str(exc)) from None
        return PlannedTensor(key, dtypes.pop(), tuple(value.shape), "tensor", False, tuple(shards))


class _Where:
    """Where a leaf is in the state, as errors name it (``state['a'][0]``): spelled out only for an error,
    as most leaves never need it."""

    __slots__ = ("path",)

    def __init__(self, path: tuple):
        self.path = path

    def __str__(self) -> str:
        return state_path(self.path)


def _shard_rank(shard: Shard, where: _Where) -> int:
    """A shard's owning rank (spec 6.5): an integer in [0, MAX_RANK], refused before anything is written."""
    rank = shard.rank
    if isinstance(rank, bool) or not hasattr(rank, "__index__") or not 0 <= operator.index(rank) <= MAX_RANK:
        raise UnsupportedValueError(f"{where}: a shard's rank must be an integer in [0, {MAX_RANK}], not {rank!r}")
    return operator.index(rank)


def merged_stats(parts: Sequence[Mapping | None]) -> Mapping | None:
    """A tensor's statistics from its shards' (spec 6.10), or None when any shard has none."""
    if not parts or any(part is None for part in parts):
        return None
    return merge_stats(parts)  # type: ignore[arg-type]


def open_for_save(repo_url: str, options: SaveOptions, *, max_hold_s: float | None = None
                  ) -> tuple[Repository, Lease]:
    """The repository (created if missing) and a save lease that keeps a garbage collector away
    (spec 11.6); the caller releases the lease."""
    repo = Repository.open(repo_url, options.storage_options, create=True, format_version=options.format_version,
                           features=options.marker_features)
    return repo, hold_save_lease(repo, max_hold_s=max_hold_s)


def refuse_taken_name(repo: Repository, name: str) -> None:
    """Checkpoints are immutable: a name with a commit record is taken."""
    if repo.storage.exists(layout.commit_key(name)):
        raise CheckpointExistsError(f"{repo.storage.describe(name)}: checkpoint already exists")


def resolve_parent(repo: Repository, parent: Any) -> tuple[str | None, set[str], Manifest | None]:
    """The parent's name, the keys of its chunks (committed, hence present and durable), and its manifest."""
    if parent is None:
        return None, set(), None
    if parent is LATEST:
        latest = repo.latest_record()  # through the commit index: a few requests whatever the repository holds
        if latest is None:
            return None, set(), None
        parent = latest.name
        try:
            manifest = repo.manifest(parent, latest)
        except CheckpointError as exc:  # a damaged latest checkpoint must not block new saves
            warnings.warn(f"not using {parent!r} as parent: {exc}", stacklevel=3, category=CheckpointWarning)
            return None, set(), None
    else:
        try:
            manifest = repo.manifest(check_name(parent))
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(f"parent checkpoint {parent!r} not found in {repo.url}") from None
    return parent, {stored_key(manifest.chunks, c) for c in manifest.chunks}, manifest


def rank_record(rank: int, timer: PhaseTimer, topology: dict, captured: Captured) -> dict:
    """This rank's own record for the manifest: its RNG states, environment (phase ``environment``),
    ``topology.ranks`` entry and ``timing.ranks`` entry (spec 9)."""
    with timer.phase("environment"):
        environment = capture_environment()
    return {"rng": rng_entry(rank, captured.rng), "environment": environment, "topology": topology,
            "timing": timer.record(rank, captured.steps, captured.resumes)}


def steps_record(entry: dict, start_ns: int) -> dict:
    """The ``timing.ranks`` entry of a rank that wrote nothing but sent its training steps (a gathered
    entry, see ``SaveOptions.gathered_steps``): no phases, no time in the save (spec 9.4)."""
    return with_steps({"rank": entry["rank"], "host": entry["host"], "start_ns": start_ns, "phases": [],
                       "total_s": 0.0}, entry["steps"], entry.get("resumes"))


def manifest_for(name: str, options: SaveOptions, *, parent: str | None, chunks: list[Chunk],
                 tensors: list[TensorEntry], new_bytes: int, state: bytes, user: bytes, records: list[dict],
                 topology: dict, collective: bool, provenance: dict | None = None,
                 steps_only: Sequence[dict] = ()) -> Manifest:
    """The manifest of a save: its tables, and every writing rank's ``rank_record`` in rank order.

    ``collective``: the environments of the ranks are merged (``environment.ranks``, spec 9.3);
    ``provenance`` defaults to the options'; ``steps_only``: ``timing.ranks`` entries of ranks that
    wrote nothing (``steps_record``).
    """
    environments = [record["environment"] for record in records]
    return Manifest(
        name=name, step=options.step, created_ns=time.time_ns(), parent=parent, chunks=chunks,
        tensors=TensorTable(tensors), state=state, user=user,
        rng=options.rng if options.rng is not None else [record["rng"] for record in records],
        environment=merge_environments(environments) if collective else environments[0],
        topology=topology,
        timing={"ranks": sorted([record["timing"] for record in records] + list(steps_only),
                                key=lambda entry: entry["rank"]),
                "steps": list(options.step_times or [])},
        totals=checkpoint_totals(tensors, chunks, new_bytes),
        provenance=provenance if provenance is not None else options.provenance,
        version=options.format_version, requires=_state_features(state, options.format_version),
    )


def _state_features(state: bytes, version: tuple[int, int]) -> frozenset[str]:
    """The required features of the state's bytes (spec 13.2): per-rank values (1.1), if it holds any."""
    if not uses_per_rank(state):
        return frozenset()
    refuse_unless_writable("per-rank-values", version, "a value that differs between ranks")
    return frozenset({"per-rank-values"})


def commit_manifest(repo: Repository, manifest: Manifest, lease: Lease, signer: SigningKey | None = None,
                    parity: str | None = None) -> None:
    """Write the manifest, then the commit record that makes the checkpoint exist, unless the save's
    lease has run out (a collector may have swept a chunk it reuses). With a ``signer``, the signature
    goes between the two (spec 10.3): a signed save is never seen committed and unsigned. With ``parity``
    ("K+M", spec 5.6), the parity of the manifest and every chunk goes before the commit record, which
    names it, and the record's copies after it."""
    data = manifest.to_bytes()
    checked = Manifest.from_bytes(data, repo.storage.describe(manifest.name))  # never commit what readers refuse
    digest = chunk_hash(data)
    key = layout.manifest_key(manifest.name, digest)
    repo.storage.write(key, data, durable=False)  # one fsync, the sync's, with its folder's
    repo.storage.sync([key])
    record = CommitRecord(
        name=manifest.name, manifest_hash=digest, manifest_size=len(data), step=manifest.step,
        created_ns=manifest.created_ns, parent=manifest.parent, totals=manifest.totals, version=manifest.version,
    )
    repo.declare(manifest.version, checked.requires)  # before the checkpoint exists: readers learn at once
    added = None
    if parity is not None:
        record, added = protect_checkpoint(repo, record, checked, *parse_parity(parity), commit=False)
    if signer is not None:
        write_signature(repo, record, signer)
    lease.check("writing the commit record")
    repo.create_commit(record)
    if added is not None and record.parity is not None:
        finish_protection(repo, added, record.parity)
