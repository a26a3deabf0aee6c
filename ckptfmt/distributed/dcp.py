"""ckptfmt as a storage layer of torch.distributed.checkpoint (DCP).

``torch.distributed.checkpoint.save(state, storage_writer=StorageWriter(url))``
(and ``async_save``, and ``load`` with ``StorageReader(url)``) keep DCP's
planners, deduplication and resharding, and store a normal ckptfmt checkpoint:
BLAKE3-named chunks, a msgpack manifest, no pickle, every byte verified on
read. What DCP hands over as pickled bytes (plain values: steps, learning
rates) is stored as the original object in the value tree instead.

Writing: the coordinator takes the save lease and chooses the parent (the
repository's latest checkpoint by default), whose name reaches every rank in its
plan; every rank stores the chunks of its write items (``write_data``, with
their statistics, and as deltas against the parent's same boxes where
``compression`` asks) and adds to its results one record of its own (its chunk
table, RNG state, environment, topology entry, phase timings and training
steps: DCP passes nothing else from the ranks to ``finish``); the coordinator's
``finish`` builds the manifest from DCP's metadata and every rank's results with
the tables every save shares (``saving/tables.py``), rebuilds the state's
nesting from the planner's mappings, and commits. Reading: ``read_metadata`` describes any ckptfmt checkpoint in DCP's
terms (each tensor as one whole chunk, keys as DCP flattens the state), and
``read_data`` reads exactly the box each read item asks for.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint import storage as dcp_storage
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.futures import Future

from ckptfmt.errors import CheckpointError, UnsupportedValueError
from ckptfmt.format.manifest import Piece, ShardEntry
from ckptfmt.format.values import TensorRef, decode_tree, encode_tree, format_key
from ckptfmt.loading.reader import CheckpointReader
from ckptfmt.metadata.resumes import forget_resumes, pending_resumes
from ckptfmt.metadata.step_timer import StepTimer
from ckptfmt.metadata.timing import PhaseTimer
from ckptfmt.metadata.topology import current_rank, rank_entry, topology_record
from ckptfmt.repository.leases import Lease
from ckptfmt.repository.repository import Repository, split_checkpoint_url
from ckptfmt.saving.chunk_writer import store_sources
from ckptfmt.saving.core import commit_manifest
from ckptfmt.saving.delta_bases import DeltaBases, Region
from ckptfmt.saving.hashcache import DEFAULT_CACHE
from ckptfmt.saving.manifests import manifest_for
from ckptfmt.saving.opening import open_for_save, refuse_taken_name, resolve_parent
from ckptfmt.saving.options import DEFAULT_WORKERS, LATEST, SaveOptions
from ckptfmt.saving.records import Captured, rank_record
from ckptfmt.saving.save import step_records
from ckptfmt.saving.tables import ManifestTables, tensor_entry
from ckptfmt.tensors.dtensors import meshes_of
from ckptfmt.tensors.dtypes import dtype_from_name, dtype_name
from ckptfmt.tensors.sources import prepare
from ckptfmt.tensors.values import torch_value

#: The index of the write result that carries a rank's own record: no state key can be this fqn.
RANK_RECORD = dcp_metadata.MetadataIndex("\x00ckptfmt: rank record")


def _checkpoint_url(checkpoint_id: str | os.PathLike | None, default: str | None) -> str:
    url = os.fspath(checkpoint_id) if checkpoint_id is not None else default
    if url is None:
        raise ValueError("a ckptfmt DCP storage layer needs a checkpoint URL (REPO/NAME)")
    split_checkpoint_url(url)  # a REPO/NAME URL with a valid name, or an error
    return url


def _named(url: str | None) -> str:
    """The checkpoint URL this layer was given (DCP hands it over through ``reset`` if not at construction)."""
    if url is None:
        raise CheckpointError("no checkpoint URL: give one to the storage layer or as DCP's checkpoint_id")
    return url


def _tensor_metadata(metadata: dcp_metadata.Metadata, fqn: str) -> dcp_metadata.TensorStorageMetadata:
    """DCP's description of tensor ``fqn``."""
    described = metadata.state_dict_metadata[fqn]
    if not isinstance(described, dcp_metadata.TensorStorageMetadata):
        raise CheckpointError(f"{fqn}: DCP describes it as bytes, but a rank wrote it as a tensor")
    return described


def _valid_url(checkpoint_id: str | os.PathLike) -> bool:
    try:
        split_checkpoint_url(os.fspath(checkpoint_id))
    except (CheckpointError, TypeError, ValueError):
        return False
    return True


#: DCP tells a coordinator nothing when another rank fails: its lease is renewed this long at most.
DCP_MAX_HOLD_S = 3600.0
#: What a checkpoint written through the storage writer records as its source.
PROVENANCE = {"source_kind": "dcp", "writer": "ckptfmt.dcp.StorageWriter"}


class StorageWriter(dcp_storage.StorageWriter):
    """Writes a DCP save as the ckptfmt checkpoint ``url`` (``REPO/NAME``; the repository is created if needed).

    The options are ``ckptfmt.save``'s: ``parent`` (the repository's latest checkpoint by default; None for
    none), ``compression`` (``delta-zstd`` and ``auto`` store chunks against the parent's same boxes),
    ``tensor_stats``, ``signer``, and ``timer``: this rank's ``ckptfmt.StepTimer``, whose steps since the
    last save are stored as this rank's (spec 9.4).
    """

    def __init__(self, url: str | os.PathLike | None = None, *, storage_options: dict | None = None,
                 compression: str | None = None, chunk_size: int | None = None, workers: int = DEFAULT_WORKERS,
                 step: int | None = None, parent: Any = LATEST, tensor_stats: bool = True, signer: Any = None,
                 timer: StepTimer | None = None):
        super().__init__()
        self.url = None if url is None else _checkpoint_url(url, None)
        self.options = SaveOptions(storage_options=storage_options, compression=compression, chunk_size=chunk_size,
                                   workers=workers, step=step, provenance=PROVENANCE, parent=parent,
                                   tensor_stats=tensor_stats, signer=signer)
        self.step_timer = timer
        step_records(timer)  # a timer of another kind is refused now, not when a rank writes
        self.timer = PhaseTimer()
        #: The coordinator's save lease (spec 11.6), from the global plan to ``finish``.
        self.lease: Lease | None = None
        #: The parent the coordinator chose, known to every rank once the global plan reaches it.
        self.parent_name: str | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self._release_lease()  # a save that failed on some rank never reached finish()
        self.url = _checkpoint_url(checkpoint_id, self.url)
        self.timer = PhaseTimer()

    def _release_lease(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _valid_url(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, rank: int | None = None,
                              **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = current_rank()[0] if rank is None else rank

    def storage_meta(self) -> dcp_metadata.StorageMeta | None:
        return dcp_metadata.StorageMeta(checkpoint_id=self.url)

    def prepare_local_plan(self, plan: dcp_planner.SavePlan) -> dcp_planner.SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[dcp_planner.SavePlan]) -> list[dcp_planner.SavePlan]:
        """On the coordinator, before any rank writes: create the repository, refuse a taken name, choose
        the parent and tell every rank its name (in the plans' ``storage_data``)."""
        repo_url, name = split_checkpoint_url(_named(self.url))
        self._release_lease()
        repo, self.lease = open_for_save(repo_url, self.options, max_hold_s=DCP_MAX_HOLD_S)
        try:
            refuse_taken_name(repo, name)
            parent_name, _, _ = resolve_parent(repo, self.options.parent)
        except BaseException:
            self._release_lease()
            raise
        return [dataclasses.replace(plan, storage_data={"parent": parent_name}) for plan in plans]

    def write_data(self, plan: dcp_planner.SavePlan,
                   planner: dcp_planner.SavePlanner) -> Future[list[dcp_storage.WriteResult]]:
        """Store this rank's tensors as chunks; plain values travel to the coordinator in the results."""
        repo = Repository.open(split_checkpoint_url(_named(self.url))[0], self.options.storage_options, create=True)
        steps = step_records(self.step_timer)
        results, items, sources, regions = [], [], [], []
        with self.timer.phase("prepare"):
            keys = _manifest_keys(planner)
            for item in plan.items:
                if item.type == dcp_planner.WriteItemType.BYTE_IO:
                    value = _original_object(planner, item)
                    encoded = encode_tree(value)
                    results.append(dcp_storage.WriteResult(item.index, len(encoded), {"value": encoded}))
                else:
                    tensor = planner.resolve_data(item)
                    if not isinstance(tensor, torch.Tensor):
                        raise CheckpointError(f"{item.index.fqn}: DCP planned a tensor but the planner resolved "
                                              f"a {type(tensor).__name__}")
                    sources.append(prepare(tensor.detach(), item.index.fqn))
                    items.append(item)
                    regions.append(_region(item, keys, sources[-1].dtype, tuple(sources[-1].shape)))
            self.parent_name = (plan.storage_data or {}).get("parent")
            bases, parent_keys = self._delta_bases(repo, regions)
        stored = store_sources(repo, sources, self.options.encoding, parent_keys=parent_keys, cache=DEFAULT_CACHE,
                               timer=self.timer, bases=bases)
        for item, source, pieces, stats in zip(items, sources, stored.pieces, stored.stats):
            results.append(dcp_storage.WriteResult(item.index, source.nbytes, {"pieces": pieces, "stats": stats}))
        record = {"rank_record": self._rank_record(planner, steps), "chunks": stored.chunks,
                  "written": stored.written_rows}
        results.append(dcp_storage.WriteResult(RANK_RECORD, 0, record))
        if self.step_timer is not None and steps is not None:
            self.step_timer.forget_stored(steps)
        future: Future = Future()
        future.set_result(results)
        return future

    def _delta_bases(self, repo: Repository, regions: list[Region | None]) -> tuple[DeltaBases | None, set[str]]:
        """The parent's chunks that this rank's items may be stored as deltas against, and the parent's keys."""
        if self.parent_name is None:
            return None, set()
        _, parent_keys, parent = resolve_parent(repo, self.parent_name)
        if parent is None or not self.options.encoding.stores_deltas:
            return None, parent_keys
        return DeltaBases(repo, parent, regions), parent_keys

    def _rank_record(self, planner: dcp_planner.SavePlanner, steps: dict | None) -> dict:
        """This rank's record (RNG state, environment, topology entry, timing with its training steps) for
        the coordinator's manifest, with the device meshes of the DTensors it saved and its process
        group's backend.

        Under ``dcp.async_save`` DCP plans and writes on its background thread, so
        the RNG state is the one when that thread got here.
        """
        state = getattr(planner, "state_dict", None)  # DefaultSavePlanner's, flattened: DTensors are values
        dist = torch.distributed
        resumes = pending_resumes()
        forget_resumes(resumes)  # the coordinator's commit is out of this rank's sight, as for its steps
        return {**rank_record(self.rank, self.timer, rank_entry(self.rank), Captured(steps=steps, resumes=resumes)),
                "meshes": meshes_of(state.values()) if isinstance(state, dict) else [],
                "backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else None}

    def finish(self, metadata: dcp_metadata.Metadata, results: list[list[dcp_storage.WriteResult]]) -> None:
        """On the coordinator, once every rank has written: the manifest, then the commit record."""
        repo_url, name = split_checkpoint_url(_named(self.url))
        repo = Repository.open(repo_url, self.options.storage_options)
        gathered, shards_of, tables, records = _gather(metadata, results)
        flat = {fqn: gathered[fqn] for fqn in metadata.state_dict_metadata if fqn in gathered}  # state order
        mappings = metadata.planner_data
        state = unflatten_state_dict(flat, mappings) if _is_mapping_table(mappings, flat) else flat
        keys: dict[str, str] = {}  # fqn -> the ckptfmt key of its path in the nested state

        numbers: dict[str, int] = {}

        def number(path: tuple, ref: TensorRef) -> int:
            if ref.key not in numbers:
                numbers[ref.key], keys[ref.key] = len(numbers), format_key(path)
            return numbers[ref.key]
        state_bytes = encode_tree(state, number)
        tensors = [tensor_entry(key, dtype_name(_tensor_metadata(metadata, fqn).properties.dtype),
                                tuple(_tensor_metadata(metadata, fqn).size), shards_of[fqn])
                   for fqn, key in keys.items()]
        meshes = [mesh for record in records for mesh in record["meshes"]]
        topology = topology_record(
            [record["topology"] for record in records], world_size=len(results),
            writer_ranks=sorted({s.rank for t in tensors for s in t.shards}), parallelism=None,
            backend=records[0]["backend"], meshes=[m for i, m in enumerate(meshes) if m not in meshes[:i]])
        manifest = manifest_for(name, self.options, parent=self.parent_name, chunks=tables.chunks.chunks,
                                tensors=tensors, new_bytes=tables.chunks.new_bytes, state=state_bytes,
                                user=encode_tree({}),
                                records=records, topology=topology, collective=True)
        if self.lease is None:
            raise CheckpointError(f"{self.url}: finish() on a writer that never planned this save "
                                  "(prepare_global_plan takes the save lease)")
        try:
            commit_manifest(repo, manifest, self.lease, self.options.signer)
        finally:
            self._release_lease()


def _original_object(planner: dcp_planner.SavePlanner, item: dcp_planner.WriteItem) -> Any:
    """The value DCP would pickle, as the state holds it (stored in the value tree instead)."""
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        raise UnsupportedValueError(f"{item.index.fqn}: ckptfmt.dcp.StorageWriter stores plain values from the "
                                    "state itself and needs a planner with lookup_object (DefaultSavePlanner)")
    return lookup(item.index)


def _is_mapping_table(mappings: Any, flat: dict) -> bool:
    """Whether the planner's data maps every flattened key to its path in the nested state."""
    return isinstance(mappings, dict) and all(isinstance(mappings.get(fqn), tuple) for fqn in flat)


def _gather(metadata: dcp_metadata.Metadata, results: list[list[dcp_storage.WriteResult]]):
    """Every rank's results as: fqn -> value (TensorRef for tensors), fqn -> [(shard, its statistics)],
    the manifest's chunk table from every rank's, and each rank's own record."""
    flat: dict[str, Any] = {}
    shards_of: dict[str, list[tuple[ShardEntry, dict | None]]] = {}
    tables = ManifestTables()
    records = []
    for rank, rank_results in enumerate(results):
        own = [result.storage_data for result in rank_results if result.index == RANK_RECORD]
        if not own:
            raise CheckpointError(f"rank {rank} of {len(results)} sent no rank record: every rank must save "
                                  "through ckptfmt.dcp.StorageWriter")
        records.append(own[0]["rank_record"])
        writer = tables.add_writer(own[0]["chunks"], own[0]["written"])
        for result in rank_results:
            fqn = result.index.fqn
            if result.index == RANK_RECORD:
                continue
            if "value" in result.storage_data:
                flat[fqn] = decode_tree(result.storage_data["value"], torch_value=torch_value)
                continue
            md = _tensor_metadata(metadata, fqn)
            offsets = tuple(result.index.offset) if result.index.offset is not None else (0,) * len(md.size)
            sizes = next(tuple(c.sizes) for c in md.chunks if tuple(c.offsets) == offsets)
            pieces = tables.pieces(writer, [Piece(*piece) for piece in result.storage_data["pieces"]])
            flat[fqn] = TensorRef(fqn)
            shards_of.setdefault(fqn, []).append((ShardEntry(offsets, sizes, rank, pieces),
                                                  result.storage_data.get("stats")))
    return flat, shards_of, tables, records


def _manifest_keys(planner: dcp_planner.SavePlanner) -> dict[str, str]:
    """fqn -> the key its tensor gets in the manifest (its path in the nested state, as ``finish`` rebuilds
    it from the planner's mappings); empty when the planner kept none (the keys are then the fqns)."""
    mappings = getattr(planner, "mappings", None)
    if not isinstance(mappings, dict):
        return {}
    return {fqn: format_key(path) for fqn, path in mappings.items() if isinstance(path, tuple)}


def _region(item: dcp_planner.WriteItem, keys: dict[str, str], dtype: str,
            shape: tuple[int, ...]) -> Region | None:
    """Where a write item's bytes lie in its tensor, for finding its base in the parent."""
    chunk = item.tensor_data
    if chunk is None:
        return None
    fqn = item.index.fqn
    return Region(keys.get(fqn, format_key((fqn,))), dtype, tuple(chunk.size), tuple(chunk.chunk.offsets), shape)


class StorageReader(dcp_storage.StorageReader):
    """Reads any ckptfmt checkpoint (``REPO/NAME``, or a repository's latest) for ``dcp.load``."""

    def __init__(self, url: str | os.PathLike | None = None, *, storage_options: dict | None = None):
        super().__init__()
        self.url = None if url is None else os.fspath(url)
        self.storage_options = storage_options
        self._reader: CheckpointReader | None = None
        self.storage_data: dict = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.url = os.fspath(checkpoint_id)
        self._reader = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return _valid_url(checkpoint_id)

    def _open(self) -> CheckpointReader:
        if self._reader is None:
            self._reader = CheckpointReader(_named(self.url), storage_options=self.storage_options, mmap=False)
        return self._reader

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        """The checkpoint in DCP's terms: keys flattened as DCP flattens a state, each tensor one chunk."""
        reader = self._open()
        entries = reader.manifest.tensors
        placeholders: dict[int, str] = {}

        def placeholder(index: int) -> torch.Tensor:
            entry = entries[index]
            tensor = torch.empty(entry.shape, dtype=dtype_from_name(entry.dtype), device="meta")
            placeholders[id(tensor)] = entry.key
            return tensor
        state = decode_tree(reader.manifest.state, placeholder, torch_value=torch_value)
        flat, mappings = flatten_state_dict(state if isinstance(state, dict) else {"state": state})
        described: dict[str, Any] = {}
        storage_data: dict[dcp_metadata.MetadataIndex, Any] = {}
        for fqn, value in flat.items():
            if isinstance(value, torch.Tensor) and id(value) in placeholders:
                whole = torch.Size([0] * value.dim())
                described[fqn] = dcp_metadata.TensorStorageMetadata(
                    dcp_metadata.TensorProperties(dtype=value.dtype), value.shape,
                    [dcp_metadata.ChunkStorageMetadata(offsets=whole, sizes=value.shape)])
                storage_data[dcp_metadata.MetadataIndex(fqn, whole)] = ("tensor", placeholders[id(value)])
            else:
                described[fqn] = dcp_metadata.BytesStorageMetadata()
                storage_data[dcp_metadata.MetadataIndex(fqn)] = ("value", value)
        return dcp_metadata.Metadata(state_dict_metadata=described, planner_data=mappings, storage_data=storage_data,
                                     storage_meta=dcp_metadata.StorageMeta(checkpoint_id=self.url))

    def set_up_storage_reader(self, metadata: dcp_metadata.Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: dcp_planner.LoadPlan) -> dcp_planner.LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[dcp_planner.LoadPlan]) -> list[dcp_planner.LoadPlan]:
        return plans

    def read_data(self, plan: dcp_planner.LoadPlan, planner: dcp_planner.LoadPlanner) -> Future[None]:
        """Each read item's box, verified, copied into the tensor the planner gives for it."""
        reader = self._open()
        for request in plan.items:
            kind, what = self.storage_data[request.storage_index]
            if request.type == dcp_planner.LoadItemType.BYTE_IO:
                buffer = io.BytesIO()
                torch.save(what, buffer)  # DCP takes plain values as torch.save bytes: made here, never stored
                buffer.seek(0)
                planner.load_bytes(request, buffer)
                continue
            start = request.storage_index.offset
            assert start is not None  # a tensor item's index has the offsets of its chunk
            offsets = tuple(s + o for s, o in zip(start, request.storage_offsets))
            target = planner.resolve_tensor(request).detach()
            if target.device.type == "cpu" and target.is_contiguous() and \
                    target.dtype == dtype_from_name(reader.tensor_info(what).dtype):
                reader.read_box(what, offsets, tuple(request.lengths), out=target)  # straight into place
            else:
                target.copy_(reader.read_box(what, offsets, tuple(request.lengths)))
            planner.commit_tensor(request, target)
        future: Future = Future()
        future.set_result(None)
        return future


__all__ = ["StorageReader", "StorageWriter"]
