"""ckptfmt as a storage layer of torch.distributed.checkpoint (DCP).

``torch.distributed.checkpoint.save(state, storage_writer=StorageWriter(url))``
(and ``async_save``, and ``load`` with ``StorageReader(url)``) keep DCP's
planners, deduplication and resharding, and store a normal ckptfmt checkpoint:
BLAKE3-named chunks, a msgpack manifest, no pickle, every byte verified on
read. What DCP hands over as pickled bytes (plain values: steps, learning
rates) is stored as the original object in the value tree instead.

Writing: every rank stores the chunks of its write items (``write_data``) and
adds to its results one record of its own (RNG state, environment, topology
entry, phase timings: DCP passes nothing else from the ranks to ``finish``);
the coordinator's ``finish`` builds the manifest from DCP's metadata and every
rank's results, rebuilds the state's nesting from the planner's mappings, and
commits. Reading: ``read_metadata`` describes any ckptfmt checkpoint in DCP's
terms (each tensor as one whole chunk, keys as DCP flattens the state), and
``read_data`` reads exactly the box each read item asks for.
"""

from __future__ import annotations

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
from ckptfmt.format.manifest import Chunk, Piece, Shard, TensorEntry
from ckptfmt.format.values import TensorRef, decode_tree, encode_tree, format_key
from ckptfmt.loading.reader import CheckpointReader
from ckptfmt.metadata.timing import PhaseTimer
from ckptfmt.metadata.topology import current_rank, rank_entry, topology_record
from ckptfmt.repository.leases import Lease
from ckptfmt.repository.repository import Repository, split_checkpoint_url
from ckptfmt.saving.chunk_writer import ChunkTable, store_sources
from ckptfmt.saving.core import (
    Captured,
    commit_manifest,
    manifest_for,
    merged_stats,
    open_for_save,
    rank_record,
    refuse_taken_name,
)
from ckptfmt.saving.hashcache import DEFAULT_CACHE
from ckptfmt.saving.options import DEFAULT_WORKERS, SaveOptions
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
    """Writes a DCP save as the ckptfmt checkpoint ``url`` (``REPO/NAME``; the repository is created if needed)."""

    def __init__(self, url: str | os.PathLike | None = None, *, storage_options: dict | None = None,
                 compression: str | None = None, chunk_size: int | None = None, workers: int = DEFAULT_WORKERS,
                 step: int | None = None):
        super().__init__()
        self.url = None if url is None else _checkpoint_url(url, None)
        self.options = SaveOptions(storage_options=storage_options, compression=compression, chunk_size=chunk_size,
                                   workers=workers, step=step, provenance=PROVENANCE)
        self.timer = PhaseTimer()
        #: The coordinator's save lease (spec 11.6), from the global plan to ``finish``.
        self.lease: Lease | None = None

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
        """On the coordinator, before any rank writes: create the repository, refuse a taken name."""
        repo_url, name = split_checkpoint_url(_named(self.url))
        self._release_lease()
        repo, self.lease = open_for_save(repo_url, self.options, max_hold_s=DCP_MAX_HOLD_S)
        try:
            refuse_taken_name(repo, name)
        except BaseException:
            self._release_lease()
            raise
        return plans

    def write_data(self, plan: dcp_planner.SavePlan,
                   planner: dcp_planner.SavePlanner) -> Future[list[dcp_storage.WriteResult]]:
        """Store this rank's tensors as chunks; plain values travel to the coordinator in the results."""
        repo = Repository.open(split_checkpoint_url(_named(self.url))[0], self.options.storage_options, create=True)
        results, items, sources = [], [], []
        with self.timer.phase("prepare"):
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
        stored = store_sources(repo, sources, compression=self.options.compression, parent_keys=set(),
                               cache=DEFAULT_CACHE, chunk_size=self.options.chunk_size,
                               workers=self.options.chunk_workers, timer=self.timer, stats=self.options.tensor_stats)
        for item, source, pieces, stats in zip(items, sources, stored.pieces, stored.stats):
            rows = [(*stored.chunks[p.chunk][:4], p.offset, p.length, p.chunk in stored.written_rows)
                    for p in pieces]  # hash, codec, size, stored size: no deltas without a parent
            results.append(dcp_storage.WriteResult(item.index, source.nbytes, {"pieces": rows, "stats": stats}))
        results.append(dcp_storage.WriteResult(RANK_RECORD, 0, {"rank_record": self._rank_record(planner)}))
        future: Future = Future()
        future.set_result(results)
        return future

    def _rank_record(self, planner: dcp_planner.SavePlanner) -> dict:
        """This rank's record (RNG state, environment, topology entry, timing) for the coordinator's
        manifest, with the device meshes of the DTensors it saved and its process group's backend.

        Under ``dcp.async_save`` DCP plans and writes on its background thread, so
        the RNG state is the one when that thread got here.
        """
        state = getattr(planner, "state_dict", None)  # DefaultSavePlanner's, flattened: DTensors are values
        dist = torch.distributed
        return {**rank_record(self.rank, self.timer, rank_entry(self.rank), Captured()),
                "meshes": meshes_of(state.values()) if isinstance(state, dict) else [],
                "backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else None}

    def finish(self, metadata: dcp_metadata.Metadata, results: list[list[dcp_storage.WriteResult]]) -> None:
        """On the coordinator, once every rank has written: the manifest, then the commit record."""
        repo_url, name = split_checkpoint_url(_named(self.url))
        repo = Repository.open(repo_url, self.options.storage_options)
        gathered, shards_of, table, records = _gather(metadata, results)
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
        tensors = []
        for fqn, key in keys.items():
            md = _tensor_metadata(metadata, fqn)
            tensors.append(TensorEntry(key=key, dtype=dtype_name(md.properties.dtype), shape=tuple(md.size),
                                       shards=tuple(shard for shard, _ in shards_of[fqn]),
                                       stats=merged_stats([stats for _, stats in shards_of[fqn]])))
        meshes = [mesh for record in records for mesh in record["meshes"]]
        topology = topology_record(
            [record["topology"] for record in records], world_size=len(results),
            writer_ranks=sorted({s.rank for t in tensors for s in t.shards}), parallelism=None,
            backend=records[0]["backend"], meshes=[m for i, m in enumerate(meshes) if m not in meshes[:i]])
        manifest = manifest_for(name, self.options, parent=None, chunks=table.chunks, tensors=tensors,
                                new_bytes=table.new_bytes, state=state_bytes, user=encode_tree({}),
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
    """Every rank's results as: fqn -> value (TensorRef for tensors), fqn -> (shard, its statistics)
    in offset order, one chunk table, and each rank's own record."""
    flat: dict[str, Any] = {}
    shards_of: dict[str, list[tuple[Shard, dict | None]]] = {}
    table = ChunkTable()
    records = []
    for rank, rank_results in enumerate(results):
        for result in rank_results:
            fqn = result.index.fqn
            if result.index == RANK_RECORD:
                records.append(result.storage_data["rank_record"])
                continue
            if "value" in result.storage_data:
                flat[fqn] = decode_tree(result.storage_data["value"], torch_value=torch_value)
                continue
            md = _tensor_metadata(metadata, fqn)
            offsets = tuple(result.index.offset) if result.index.offset is not None else (0,) * len(md.size)
            sizes = next(tuple(c.sizes) for c in md.chunks if tuple(c.offsets) == offsets)
            pieces = [Piece(table.add(Chunk(hash_, codec, size, stored_size), written), offset, length)
                      for hash_, codec, size, stored_size, offset, length, written in result.storage_data["pieces"]]
            flat[fqn] = TensorRef(fqn)
            shards_of.setdefault(fqn, []).append((Shard(offsets, sizes, rank, tuple(pieces)),
                                                  result.storage_data.get("stats")))
    for shards in shards_of.values():
        shards.sort(key=lambda shard: shard[0].offsets)
    if len(records) != len(results):
        raise CheckpointError(f"{len(results) - len(records)} of {len(results)} ranks sent no rank record: "
                              "every rank must save through ckptfmt.dcp.StorageWriter")
    return flat, shards_of, table, records


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
