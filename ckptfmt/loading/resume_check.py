"""What a resume restored, part by part, on record (issue 29, part 3; spec 9.4 ``resumes``, 1.8).

``record_resume(checkpoint, live)`` runs once the resume is done (the model, the
optimizers, the schedulers, the data loaders loaded): for each part the caller
names (``{"model": model, "optimizer": optimizer, ...}``), the live object's
state is compared with what the checkpoint stored under that key, and the
verdict is ``equal``, ``missing`` (the live object lacks entries that were
stored: an optimizer whose state was dropped) or ``different`` (it has them
all, with other values: a scheduler that was never loaded, a model loaded
from elsewhere), with the first keys that differ. The record, with where the run resumed from and the world size
then and now, is kept for this process's next save (``metadata.resumes``).

Tensors are compared without reading them back. Those this process has just
loaded from the checkpoint (``ckptfmt.load``, the integrations' loads) were
verified against their chunks then and fingerprinted (``loaded_fingerprints``:
a sample of each one's bytes, whole up to 4 KiB); the live tensor's fingerprint
is compared with that, in microseconds whatever its size. That finds a state
dropped, never loaded or loaded from elsewhere; a change confined to bytes
between the samples of a large tensor it does not. Other tensors are checked
exactly: a live tensor's bytes hashed where a chunk holds nothing else (BLAKE3,
the chunk's own name) and read back where a chunk packs several small ones.
Plain values (step counters, learning rates, positions) are compared exactly.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from ckptfmt.errors import UnsupportedValueError
from ckptfmt.format.hashing import chunk_hash
from ckptfmt.format.manifest import TensorEntry
from ckptfmt.format.per_rank import PerRankValues
from ckptfmt.format.plain_values import plain_leaves, plain_tree
from ckptfmt.format.rng_states import comparable_entry
from ckptfmt.format.values import format_key
from ckptfmt.loading.loaded_fingerprints import dtype_name, fingerprint, fingerprint_value, leaves, remembered
from ckptfmt.loading.reader import CheckpointReader
from ckptfmt.metadata.resumes import note_resume
from ckptfmt.metadata.rng import capture_states
from ckptfmt.repository.repository import resolve
from ckptfmt.tensors.sources import prepare

#: Keys named per part in a record: enough to say where to look, bounded whatever the state's size.
KEYS_SHOWN = 8
VERDICTS = ("equal", "missing", "different", "not stored")
#: A part that is a step's input: a data loader's position feeds its ``batches``, the ``rng`` part the
#: ``generators``.
FEEDS = ("batches", "generators")


@dataclass
class PartCheck:
    """One part of the state (a top-level key of the checkpoint) compared with its live object."""

    part: str
    verdict: str  # one of VERDICTS
    #: Tensors and plain values the checkpoint stored under the part, and how many of them the live
    #: object lacks or holds otherwise.
    stored: int = 0
    missing: int = 0
    different: int = 0
    #: The first keys missing or different (at most KEYS_SHOWN).
    keys: list[str] = field(default_factory=list)
    #: What the part feeds a step where it is a step's input rather than its state (``FEEDS``): its
    #: effect shows in the steps' signatures, so certify weighs it by them (spec 9.4, 1.10).
    feeds: str | None = None

    def to_dict(self) -> dict:
        """The stored form of the part (spec 9.4 ``resumes``' ``parts``): ``feeds`` where it is set."""
        stored = asdict(self)
        if self.feeds is None:
            del stored["feeds"]
        return stored


@dataclass
class ResumeRecord:
    """One rank's resume: where from, when, on how many ranks, and what each part holds now."""

    repository: str
    name: str
    manifest: str
    step: int | None
    created_ns: int
    resumed_ns: int
    rank: int
    world_size_then: int | None
    world_size_now: int
    parts: list[PartCheck]

    @property
    def restored(self) -> bool:
        """Whether every part compared holds what the checkpoint stored."""
        return all(part.verdict in ("equal", "not stored") for part in self.parts)

    def to_dict(self) -> dict:
        """The stored form (spec 9.4 ``resumes``)."""
        return {"from": {"repository": self.repository, "name": self.name, "manifest": self.manifest,
                         "step": self.step, "created_ns": self.created_ns},
                "resumed_ns": self.resumed_ns, "rank": self.rank,
                "world_size": [self.world_size_then, self.world_size_now],
                "parts": [part.to_dict() for part in self.parts]}


def record_resume(checkpoint: str | os.PathLike | CheckpointReader, live: Mapping[str, Any], *,
                  rng: bool = False, storage_options: dict | None = None, rank: int | None = None,
                  checked: Sequence[PartCheck] = (), loaders: Collection[str] = (),
                  every_part: bool = False) -> ResumeRecord:
    """Compare the live objects a resume restored with ``checkpoint`` and keep the record for this
    process's next save (see the module's docstring); returns it.

    ``live``: part name (the checkpoint's top-level key) -> the object now holding it: anything with
    ``state_dict()`` (a model, an optimizer, a scheduler, a stateful data loader) or a state itself.
    ``rng``: also compare this process's generators with the checkpoint's record of this rank's
    (right after ``restore_rng``, before anything draws). ``rank``: this process's rank in the
    checkpoint's records (default: its rank under torch.distributed, else 0). ``checked``: parts
    compared earlier, such as ``check_generators``' where the generators are restored before the
    rest is loaded (a framework whose restore draws from them). ``loaders``: the parts that are data
    loaders' positions where ``live`` holds their states (a live ``DataLoader`` or ``Sampler`` is
    known as one): they feed a step its batches, which its signature shows (``PartCheck.feeds``).
    ``every_part``: the checkpoint's top-level parts ``live`` lacks go on record too, as parts nothing
    restored (``missing``): for a load that took only some of them (``strict=False``).
    """
    reader = checkpoint if isinstance(checkpoint, CheckpointReader) else _reader(checkpoint, storage_options)
    try:
        rank = _rank() if rank is None else rank
        manifest = reader.manifest
        parts = check_parts(reader, live, rank=rank, loaders=loaders, every_part=every_part)
        parts += checked
        if rng:
            parts.append(_check_rng(reader.metadata["rng"], rank))
        record = reader.commit
        then = manifest.topology.get("world_size") if isinstance(manifest.topology, dict) else None
        result = ResumeRecord(
            repository=reader.repository.url, name=reader.name, manifest=record.manifest_hash, step=record.step,
            created_ns=record.created_ns, resumed_ns=time.time_ns(), rank=rank,
            world_size_then=then if type(then) is int else None, world_size_now=_world_size(), parts=parts)
    finally:
        if reader is not checkpoint:
            reader.close()
    note_resume(result.to_dict(), reader.repository)
    return result


def check_parts(reader: CheckpointReader, live: Mapping[str, Any], *, rank: int | None = None,
                loaders: Collection[str] = (), every_part: bool = False) -> list[PartCheck]:
    """``record_resume``'s comparison of the live parts with the checkpoint, for a caller that records
    them later (``checked=``): parts that change as soon as training goes on (a data loader's position),
    compared at once, beside parts compared when the first step begins. ``every_part``: as
    ``record_resume``'s."""
    rank = _rank() if rank is None else rank
    tree = plain_tree(reader.manifest)
    stored_values = {format_key(path): value for path, value in plain_leaves(tree)}
    per_rank = {name for name, value in tree.items() if isinstance(value, PerRankValues)} \
        if isinstance(tree, dict) else set()
    states = {name: _state_of(obj) for name, obj in live.items()}
    roots = {name: (name,) if name not in per_rank else (name, rank) for name in states}
    keyed = {name: [(format_key(path), leaf) for path, leaf in leaves(roots[name], state)]
             for name, state in states.items()}
    if every_part and isinstance(tree, dict):  # a part nothing took: every entry of it missing
        for name in tree:
            if name not in live:
                roots[name] = (name,) if name not in per_rank else (name, rank)
                keyed[name] = []
    comparer = _Tensors(reader, {key: leaf for found in keyed.values() for key, leaf in found
                                 if isinstance(leaf, torch.Tensor)})
    checks = [_check_part(reader, name, keyed[name], stored_values, roots[name], comparer) for name in keyed]
    for check in checks:
        if check.part in loaders or isinstance(live.get(check.part), (torch.utils.data.DataLoader,
                                                                  torch.utils.data.Sampler)):
            check.feeds = "batches"
    return checks


def _reader(url: str | os.PathLike, storage_options: dict | None) -> CheckpointReader:
    """The checkpoint at ``url``, its manifest taken from the load this process has just made of it
    (the commit record is read: a checkpoint saved again under its name has another manifest)."""
    repository, name = resolve(url, storage_options)
    commit = repository.commit(name)
    found = remembered(commit.manifest_hash)
    return CheckpointReader.from_parts(repository, name, read=(commit, found[0]) if found is not None else None)


def _state_of(obj: Any) -> Any:
    state_dict = getattr(obj, "state_dict", None)
    return state_dict() if callable(state_dict) else obj


def _check_part(reader: CheckpointReader, part: str, leaves: list[tuple[str, Any]], stored_values: dict[str, Any],
                root: tuple, comparer: _Tensors) -> PartCheck:
    """``leaves``: the live part's (key, leaf); ``root``: where the part's keys start (``(part, rank)`` for a
    part saved as ``PerRank``, each rank's data loader position: this rank's)."""
    prefix = format_key(root) + "/"
    whole = format_key(root)
    tensors = {entry.key: entry for entry in reader.manifest.tensors
               if entry.key == whole or entry.key.startswith(prefix)}
    values = {key: value for key, value in stored_values.items() if key == whole or key.startswith(prefix)}
    check = PartCheck(part, "equal", stored=len(tensors) + len(values))
    if not check.stored:
        check.verdict = "not stored"
        return check
    live_tensors: dict[str, Any] = {}
    live_values: dict[str, Any] = {}
    for key, leaf in leaves:
        if isinstance(leaf, np.ndarray) and key in tensors:  # saved as a tensor of kind "numpy"
            leaf = _as_saved_tensor(leaf)
        (live_tensors if isinstance(leaf, torch.Tensor) else live_values)[key] = leaf
    wrong: list[str] = []
    for key, entry in tensors.items():
        if key not in live_tensors:
            check.missing += 1
            wrong.append(key)
        elif not comparer.same(entry, live_tensors[key]):
            check.different += 1
            wrong.append(key)
    for key, value in values.items():
        if key not in live_values:
            check.missing += 1
            wrong.append(key)
        elif not _same_value(value, live_values[key]):
            check.different += 1
            wrong.append(key)
    check.keys = wrong[:KEYS_SHOWN]
    if check.missing:
        check.verdict = "missing"
    elif check.different:
        check.verdict = "different"
    return check


def _as_saved_tensor(array: np.ndarray) -> torch.Tensor | np.ndarray:
    """A live numpy array as the tensor a save of it stores; one a save refuses stays as it is."""
    try:
        return prepare(array, "array").tensor
    except UnsupportedValueError:
        return array


def _same_value(stored: Any, live: Any) -> bool:
    """Plain values equal as the checkpoint keeps them (spec 7.3: the type too), tuples as lists, a NaN
    equal to a NaN."""
    if isinstance(stored, (list, tuple)) and isinstance(live, (list, tuple)):
        return len(stored) == len(live) and all(_same_value(a, b) for a, b in zip(stored, live))
    if isinstance(stored, float) and isinstance(live, float) and math.isnan(stored) and math.isnan(live):
        return True
    if type(stored) is not type(live):
        return False
    try:
        return bool(stored == live)
    except Exception:  # an object whose comparison fails is not equal
        return False


class _Tensors:
    """Compares live tensors with the stored ones: by fingerprint where this process loaded them (large
    tensors, ``loaded_fingerprints.remembered``), else exactly by the chunks' hashes, a chunk that packs several small
    tensors rebuilt from the live ones; read back only where that cannot tell."""

    def __init__(self, reader: CheckpointReader, live: dict[str, Any]):
        self.reader = reader
        self.live = live
        found = remembered(reader.commit.manifest_hash)
        self.loaded = found[1] if found is not None else {}
        self._users: dict[int, list[tuple[str, int, int, int]]] | None = None
        self._packed: dict[int, bool] = {}

    def same(self, entry: TensorEntry, live: torch.Tensor) -> bool:
        """Whether ``live`` holds the stored tensor ``entry``: dtype, shape, then bytes."""
        loaded = fingerprint_value(self.loaded.get(entry.key))
        if loaded is not None:
            return fingerprint(live) == loaded
        if entry.same_as is not None:
            entry = self.reader.manifest.tensors[entry.same_as]
        if callable(getattr(live, "to_local", None)):  # a DTensor: this rank's shard, the box at its offsets
            return self._same_shard(entry, live)
        if dtype_name(live.dtype) != entry.dtype or tuple(live.shape) != tuple(entry.shape):
            return False
        data = _bytes_of(live)
        if len(entry.shards) == 1 and self._pieces_match(entry.shards[0].pieces, data):
            return True
        stored = self.reader.read_array(entry.key).reshape(-1).view(np.uint8)
        return bool(np.array_equal(stored, data))

    def _same_shard(self, entry: TensorEntry, live: Any) -> bool:
        """A DTensor's local shard against the stored shard at its offsets (by the chunks' hashes), else
        against the box read back there (another world size cuts other shards)."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = live.to_local()
        if dtype_name(local.dtype) != entry.dtype or tuple(live.shape) != tuple(entry.shape):
            return False
        shape, offsets = compute_local_shape_and_global_offset(live.shape, live.device_mesh, live.placements)
        if not math.prod(shape):
            return True
        data = _bytes_of(local)
        for shard in entry.shards:
            if tuple(shard.offsets) == tuple(offsets) and tuple(shard.shape) == tuple(shape) \
                    and self._pieces_match(shard.pieces, data):
                return True
        stored = self.reader.read_box(entry.key, tuple(offsets), tuple(shape))
        return bool(np.array_equal(_bytes_of(stored), data))

    def _pieces_match(self, pieces, data: np.ndarray) -> bool:
        chunks, position = self.reader.manifest.chunks, 0
        for piece in pieces:
            chunk = chunks[piece.chunk]
            if piece.offset == 0 and piece.length == chunk.size:
                if chunk_hash(data[position:position + piece.length], parallel=True) != chunk.hash:
                    return False
            elif not self._packed_chunk_matches(piece.chunk):
                return False
            position += piece.length
        return position == data.size

    def _packed_chunk_matches(self, row: int) -> bool:
        """Whether the live tensors whose bytes a packed chunk holds rebuild it exactly (False also where
        one of them is not live: the tensors are then read back)."""
        if row not in self._packed:
            chunk = self.reader.manifest.chunks[row]
            rebuilt = bytearray(chunk.size)  # the gaps between packed tensors are zeros (spec 5.2)
            for key, position, offset, length in self._chunk_users().get(row, ()):
                live = self.live.get(key)
                entry = self.reader.manifest.tensors[self.reader.lookup(key)]
                if not isinstance(live, torch.Tensor) or callable(getattr(live, "to_local", None)) \
                        or dtype_name(live.dtype) != entry.dtype or tuple(live.shape) != tuple(entry.shape):
                    break
                rebuilt[offset:offset + length] = _bytes_of(live)[position:position + length].tobytes()
            else:
                self._packed[row] = chunk_hash(rebuilt) == chunk.hash
            self._packed.setdefault(row, False)
        return self._packed[row]

    def _chunk_users(self) -> dict[int, list[tuple[str, int, int, int]]]:
        """Chunk row -> (tensor key, byte position in the tensor, offset in the chunk, length) of each
        piece of a single-shard tensor stored in it."""
        if self._users is None:
            self._users = {}
            for entry in self.reader.manifest.tensors:
                if entry.same_as is not None or len(entry.shards) != 1:
                    continue
                position = 0
                for piece in entry.shards[0].pieces:
                    self._users.setdefault(piece.chunk, []).append((entry.key, position, piece.offset, piece.length))
                    position += piece.length
        return self._users


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, np.uint8)


def check_generators(checkpoint: CheckpointReader, *, rank: int | None = None) -> PartCheck:
    """The ``rng`` part of a resume's record: this process's generators now against the checkpoint's
    record of rank ``rank``'s (default: this process's), to call right after ``restore_rng``."""
    return _check_rng(checkpoint.metadata["rng"], _rank() if rank is None else rank)


def _check_rng(stored: list, rank: int) -> PartCheck:
    """This process's generators now against the checkpoint's record of this rank's."""
    entry = next((e for e in stored if isinstance(e, dict) and e.get("rank") == rank), None)
    check = PartCheck("rng", "equal", stored=0, feeds="generators")
    if entry is None:
        check.verdict = "not stored"
        return check
    entry, now = comparable_entry(entry), comparable_entry(capture_states())
    for name in ("torch_cpu", "numpy", "python", "cuda"):
        if name in entry:
            check.stored += 1
            if not _same_value(_plain(entry[name]), _plain(now.get(name))):
                check.different += 1
                check.keys.append(name)
    if check.different:
        check.verdict = "different"
    return check


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
