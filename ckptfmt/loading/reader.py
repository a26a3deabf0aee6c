"""Reading checkpoints: ``open`` (lazy, per tensor), ``load`` (everything) and ``restore_rng``."""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from ckptfmt._collector import collector_paused
from ckptfmt._teardown import if_distributed
from ckptfmt.errors import CheckpointError, CheckpointNotFoundError, CheckpointWarning, CorruptDataError, ManifestError
from ckptfmt.format import codecs
from ckptfmt.format.dtypes import itemsize
from ckptfmt.format.manifest import Manifest, Piece, TensorEntry
from ckptfmt.format.shards import ShardEntry, ShardGrid, chunk_rows
from ckptfmt.format.signatures import TrustedKeys
from ckptfmt.format.values import decode_tree
from ckptfmt.loading.checkpoint import Checkpoint
from ckptfmt.loading.healing import HealFrom
from ckptfmt.loading.load_into import load_into
from ckptfmt.loading.loaded_fingerprints import (
    EXACT_BYTES,
    FileFingerprint,
    Fingerprint,
    fingerprint,
    remember_fingerprints,
    remember_load,
)
from ckptfmt.loading.threads import read_threads
from ckptfmt.loading.verified_files import VerifyMode
from ckptfmt.metadata.rng import apply_rng
from ckptfmt.metadata.topology import current_rank
from ckptfmt.repository.repository import CommitRecord, Repository, resolve
from ckptfmt.tensors.dtypes import dtype_from_name
from ckptfmt.tensors.sources import byte_view, empty, finish
from ckptfmt.tensors.values import torch_value


class CheckpointReader(Checkpoint):
    """A committed checkpoint, opened lazily: tensors are read only when asked for.

    Use as a context manager, like safetensors' ``safe_open``::

        with ckptfmt.open("runs/exp1/step-100") as ckpt:
            weight = ckpt.get_tensor("model/layers.0.attn.weight")
    """

    def __init__(self, url: str | os.PathLike, *, storage_options: dict | None = None,
                 map_location: str | torch.device | None = "cpu", mmap: bool = True,
                 heal_from: HealFrom = None, trusted_keys: TrustedKeys = None, verify: VerifyMode = True):
        repository, name = resolve(url, storage_options)
        self._setup(repository, name, map_location, mmap, heal_from, trusted_keys, verify=verify)

    @classmethod
    def from_parts(cls, repository: Repository, name: str, map_location: str | torch.device | None = "cpu",
                   mmap: bool = True, heal_from: HealFrom = None, trusted_keys: TrustedKeys = None,
                   read: tuple[CommitRecord, Manifest] | None = None) -> CheckpointReader:
        """Open checkpoint ``name`` of an already opened repository (``read``: its commit record and whole
        manifest, where the caller has read them)."""
        reader = cls.__new__(cls)
        reader._setup(repository, name, map_location, mmap, heal_from, trusted_keys, read)
        return reader

    torch_value = staticmethod(torch_value)

    def _setup(self, repository: Repository, name: str, map_location, mmap: bool, heal_from: HealFrom,
               trusted_keys: TrustedKeys, read: tuple[CommitRecord, Manifest] | None = None,
               verify: VerifyMode = True) -> None:
        if_distributed()
        Checkpoint.__init__(self, repository, name, trusted_keys=trusted_keys, heal_from=heal_from, read=read,
                            verify=verify)
        self.mmap = mmap
        self.map_location = torch.device(map_location if map_location is not None else "cpu")
        #: Fingerprints (``loaded_fingerprints``) of the large tensors ``load_state(remember=True)`` gave, by
        #: key, for a resume's check: sampled as read, a view of an unhashed map's from its chunk file when
        #: the check asks (sampling the view would fault 16 pages of each map in: about half of a warm
        #: ``verify=False`` load of 38 such tensors).
        self.fingerprints: dict[str, Fingerprint] = {}

    # -- reading -------------------------------------------------------------
    def get_tensor(self, key: str):
        """Read one tensor (only its chunks), verified, on ``map_location``."""
        return self._read(self.lookup(key), parallel=True)

    def read_box(self, key: str, offsets: tuple[int, ...], shape: tuple[int, ...], *,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """The box of tensor ``key`` that starts at ``offsets`` and has ``shape``, verified, on CPU.

        Only the chunks holding bytes of the box are read, whatever the shards it
        was saved as: this is how a rank loads its shard at another world size.
        Within each overlapping shard, the box's rows form one span of the
        shard's bytes, read from the pieces covering it. ``out`` (a contiguous
        CPU tensor of the box's shape and the tensor's dtype) receives the box
        in place; a span that is a whole uncompressed chunk is read straight into it.
        """
        entry = self.manifest.tensors[self.lookup(key)]
        if entry.same_as is not None:
            entry = self.manifest.tensors[entry.same_as]
        offsets, shape = tuple(int(o) for o in offsets), tuple(int(n) for n in shape)
        if len(offsets) != len(entry.shape) or len(shape) != len(entry.shape) or any(
                o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, shape, entry.shape)):
            raise CheckpointError(f"{self.url}: box at {list(offsets)} of shape {list(shape)} is not inside "
                                  f"tensor {key!r} of shape {list(entry.shape)}")
        dtype = dtype_from_name(entry.dtype)
        if out is None:
            out = empty(entry.dtype, shape)
        elif tuple(out.shape) != shape or out.dtype != dtype or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous CPU {dtype} tensor of shape {list(shape)}")
        if out.numel() == 0:
            return out
        for shard in _overlapping(entry.shards, offsets, shape):
            low = [max(o, s) for o, s in zip(offsets, shard.offsets)]
            high = [min(o + n, s + m) for o, n, s, m in zip(offsets, shape, shard.offsets, shard.shape)]
            if any(lo >= hi for lo, hi in zip(low, high)):
                continue
            target = out[tuple(slice(lo - o, hi - o) for lo, hi, o in zip(low, high, offsets))]
            with self._reading(entry):
                self._read_part(entry, shard, [lo - s for lo, s in zip(low, shard.offsets)],
                                [hi - lo for lo, hi in zip(low, high)], target)
        return out

    @contextmanager
    def _reading(self, entry: TensorEntry):
        """A chunk that is damaged or missing is named with the tensor that needed it, as verify does."""
        try:
            yield
        except (CorruptDataError, CheckpointNotFoundError) as exc:
            raise self._named(entry, exc) from None

    def _named(self, entry: TensorEntry, exc: CorruptDataError | CheckpointNotFoundError) -> CheckpointError:
        return type(exc)(f"{self.url}: tensor {entry.key!r}: {exc}{self._held_elsewhere(entry)}")

    def _held_elsewhere(self, entry: TensorEntry) -> str:
        """Where a node-scoped checkpoint's nodes hold the tensor's chunks (spec 9.8), for a chunk not here."""
        placement = self.manifest.placement
        if placement is None:
            return ""
        hosts = sorted({host for row in set(chunk_rows(entry.shards)) for host in placement.holders(row)})
        return (f" (a node-scoped checkpoint: this tensor's chunks are on {', '.join(hosts) or 'no node'}; "
                f"this machine is {socket.gethostname()})")

    def _read_part(self, entry: TensorEntry, shard, start: list[int], size: list[int], target: torch.Tensor) -> None:
        """Copy the part of ``shard`` at ``start`` (in the shard) of ``size`` into ``target``."""
        width = itemsize(entry.dtype)
        strides = [1] * len(shard.shape)
        for dim in range(len(shard.shape) - 2, -1, -1):
            strides[dim] = strides[dim + 1] * shard.shape[dim + 1]
        first = sum(i * s for i, s in zip(start, strides))
        last = sum((i + n - 1) * s for i, n, s in zip(start, size, strides))
        begin, end = first * width, (last + 1) * width
        covering, position = [], 0
        for piece in shard.pieces:
            if position < end and begin < position + piece.length:
                covering.append((position, piece))
            position += piece.length
        whole_rows = target.is_contiguous() and (end - begin) == target.numel() * width
        if whole_rows and len(covering) == 1 and covering[0][0] == begin and covering[0][1].offset == 0 \
                and self._chunks.can_read_into(covering[0][1].chunk, end - begin):
            self._chunks.read_into(covering[0][1].chunk, byte_view(target))  # no copy at all
            return
        if len(covering) == 1:  # the span lies in one chunk: view it there
            position, piece = covering[0]
            at = piece.offset + begin - position
            span: memoryview | bytearray = memoryview(self._chunks.read(piece.chunk))[at : at + end - begin]
        else:
            span = bytearray(end - begin)
            for position, piece in covering:
                lo, hi = max(begin, position), min(end, position + piece.length)
                data = memoryview(self._chunks.read(piece.chunk))
                at = piece.offset + lo - position
                span[lo - begin : hi - begin] = data[at : at + hi - lo]
        with warnings.catch_warnings():  # a read-only view of the chunk: only read, then copied
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(span, dtype=target.dtype)
        target.copy_(flat.as_strided(size, strides, 0))

    def load_state(self, *, workers: int | None = None, without: Iterable[str] = (), remember: bool = False) -> Any:
        """The whole saved state, type-exact, every chunk verified.

        ``workers`` threads read and hash chunks (None: ``read_threads``); many reads in flight
        keep the disk's queue full (1.3 GB state, cold: 16 threads 0.95 s, 4 threads 1.16 s).
        ``without``: top-level entries of a state that is a dict to leave out, their
        tensors unread (the rest of a checkpoint whose model was loaded in place).
        ``remember``: keep the large tensors' fingerprints in ``fingerprints`` as they are read, for a
        resume's check (``ckptfmt.load`` does).
        """
        if workers is None:
            workers = read_threads(sum(chunk.stored_size for chunk in self.manifest.chunks))
        tensors = self.manifest.tensors
        left_out = set(without)
        wanted: Iterable[int] = range(len(tensors))
        if left_out:
            tree = decode_tree(self.manifest.state, _Unread, torch_value=torch_value)
            if not isinstance(tree, dict):
                raise CheckpointError(f"{self.url}: load_state(without=...) needs a state that is a dict, "
                                      f"not a {type(tree).__name__}")
            wanted = sorted(_unread_indices([value for key, value in tree.items() if key not in left_out]))
            if wanted and not 0 <= wanted[0] <= wanted[-1] < len(tensors):
                raise CheckpointError(f"{self.url}: state refers to tensor {wanted[-1]}, table has {len(tensors)}")
        with collector_paused():  # a tensor object per entry (tracked, acyclic): a third of a load of 100,000
            loaded = self._read_all(wanted, workers, remember)

        def resolve_tensor(index: int):
            if not 0 <= index < len(loaded):
                raise CheckpointError(f"{self.url}: state refers to tensor {index}, table has {len(loaded)}")
            return loaded[index]

        with collector_paused():
            state = decode_tree(self.manifest.state, resolve_tensor, torch_value=torch_value)
        if left_out:
            state = type(state)((key, value) for key, value in state.items() if key not in left_out)
        return state

    def _read_all(self, wanted: Iterable[int], workers: int, remember: bool) -> list[Any]:
        """The tensors of entries ``wanted`` (a ``same_as`` entry: its first's object), None elsewhere."""
        tensors = self.manifest.tensors
        loaded: list[Any] = [None] * len(tensors)
        first_of = {index: tensors[index].same_as for index in wanted}  # same_as: an earlier entry's bytes
        firsts = sorted({index if first is None else first for index, first in first_of.items()})
        mapped = self._mapped_chunks(firsts) if workers > 1 else None
        hashed = [row for row in mapped or () if self._chunks.would_hash(row)]  # "once": files not checked yet
        if hashed:  # verified maps: hash them on every core, largest first, then build the views here
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptfmt-load") as pool:
                list(pool.map(self._map_ahead, hashed))
        if workers <= 1 or self._reads_are_views() or mapped is not None:
            for index in firsts:
                loaded[index] = self._read(index, remember=remember)
        else:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckptfmt-load") as pool:
                for index, value in zip(firsts, pool.map(partial(self._read, remember=remember), firsts)):
                    loaded[index] = value
        for index, first in first_of.items():
            if first is not None:
                loaded[index] = loaded[first]
                if tensors[first].key in self.fingerprints:
                    self.fingerprints[tensors[index].key] = self.fingerprints[tensors[first].key]
        return loaded

    def _map_ahead(self, row: int) -> None:
        """Map and verify chunk ``row`` for the views built next; a chunk that fails is left to its tensor's
        read, which names the tensor (and heals it where it can)."""
        try:
            self._chunks.mapped(row)
        except CheckpointError:
            pass

    def _mapped_chunks(self, indexes: list[int]) -> list[int] | None:
        """The chunk rows of entries ``indexes``, largest first, when every entry is one piece of an
        uncompressed local chunk (so a view of its verified map): then the only work is hashing the maps,
        and a thread per tensor only adds hand-offs (99 tensors of 90 MB, warm: 15.5 ms -> 13.5 ms)."""
        if not (self.mmap and self._chunks.verify is not False and self._chunks.storage.zero_copy_reads
                and self.map_location.type == "cpu"):
            return None
        tensors, chunks = self.manifest.tensors, self.manifest.chunks
        rows: set[int] = set()
        for index in indexes:
            shards = tensors[index].shards
            if isinstance(shards, ShardGrid) or len(shards) != 1 or len(shards[0].pieces) > 1:
                return None
            rows.update(piece.chunk for piece in shards[0].pieces)
        if any(chunks[row].codec != codecs.NONE for row in rows):
            return None
        return sorted(rows, key=lambda row: -chunks[row].size)

    def _reads_are_views(self) -> bool:
        """Whether the tensors are views of local memory maps that no read hashes (``verify=False``): then
        threads only add their hand-offs (99 tensors of 90 MB, warm: 5 ms in threads, 1.5 ms without)."""
        return (self.mmap and self._chunks.verify is False and self._chunks.storage.zero_copy_reads
                and self.map_location.type == "cpu")

    def _read(self, index: int, parallel: bool = False, *, remember: bool = False):
        """Tensor ``index``; ``remember``: a large one's fingerprint kept too (``fingerprints``)."""
        entry = self.manifest.tensors[index]
        if entry.same_as is not None:
            entry = self.manifest.tensors[entry.same_as]
        try:  # as ``_reading`` does, inline: a context manager's frame is 3 us of each tensor's few
            tensor = self._mapped(entry, parallel, remember) if self.mmap else None
            if tensor is None:
                tensor = self._assemble(entry, parallel)
        except (CorruptDataError, CheckpointNotFoundError) as exc:
            raise self._named(entry, exc) from None
        if self.map_location.type != "cpu" and entry.kind != "numpy":
            tensor = tensor.to(self.map_location)
        try:
            value = finish(tensor, entry.kind, entry.requires_grad)
        except (RuntimeError, TypeError) as exc:  # e.g. a numpy kind with a dtype numpy lacks
            raise ManifestError(f"{self.url}: tensor {entry.key!r} cannot be rebuilt as saved: {exc}") from None
        if remember and isinstance(value, torch.Tensor) and value.nbytes > EXACT_BYTES \
                and entry.key not in self.fingerprints:  # not a view's file fingerprint: sampled here
            self.fingerprints[entry.key] = fingerprint(value)
        return value

    def _mapped(self, entry: TensorEntry, parallel: bool, remember: bool = False) -> torch.Tensor | None:
        """The tensor as a view of its memory-mapped chunk, when it lies whole in one uncompressed chunk."""
        if len(entry.shards) != 1 or len(entry.shards[0].pieces) != 1:
            return None
        piece = entry.shards[0].pieces[0]
        mapping = self._chunks.mapped(piece.chunk, parallel=parallel)
        size = itemsize(entry.dtype)
        if mapping is None or piece.offset % size:
            return None
        tensor = torch.frombuffer(mapping, dtype=dtype_from_name(entry.dtype), count=piece.length // size,
                                  offset=piece.offset)
        if len(entry.shape) != 1:  # a 1-D view has its shape already (the reshape is 1.5 us of each tensor's 5)
            tensor = tensor.reshape(entry.shape)
        if remember and piece.length > EXACT_BYTES and self._chunks.verify is not True \
                and entry.kind != "numpy":  # hashed: its pages are in; numpy: not a tensor once finished
            self._fingerprint_view(entry.key, tensor, piece)
        return tensor

    def _fingerprint_view(self, key: str, tensor: torch.Tensor, piece: Piece) -> None:
        """Keep ``tensor``'s fingerprint, to be read from the windows of its chunk file (the bytes its map
        shows, as copy-on-write maps of immutable files do until written) when a resume's check asks;
        where they cannot be read, the check compares the tensor exactly."""
        read = self._chunks.windows_reader(piece.chunk)
        if read is not None:
            self.fingerprints[key] = FileFingerprint(read, piece.offset, piece.length, tensor.dtype, tensor.shape)

    def _assemble(self, entry: TensorEntry, parallel: bool) -> torch.Tensor:
        """The tensor in fresh memory, its shards' pieces read into place.

        Each chunk is read (and decoded) once for the whole tensor however many
        pieces use it; a shard of a sharded tensor gets a buffer of its own
        until its last piece arrives, then takes its place in the tensor.
        """
        try:
            tensor = empty(entry.dtype, entry.shape)
        except RuntimeError as exc:
            raise CheckpointError(f"{self.url}: cannot allocate tensor {entry.key!r}: {exc}") from None
        whole = len(entry.shards) == 1
        buffers: dict[int, torch.Tensor] = {}
        waiting = [len(shard.pieces) for shard in entry.shards]

        def region(shard_index: int, position: int, length: int) -> memoryview:
            if whole:
                return byte_view(tensor)[position : position + length]
            if shard_index not in buffers:
                buffers[shard_index] = empty(entry.dtype, entry.shards[shard_index].shape)
            return byte_view(buffers[shard_index])[position : position + length]

        for index, uses in _uses_by_chunk(entry).items():
            if len(uses) == 1 and self._chunks.can_read_into(index, uses[0][2].length):
                shard_index, position, piece = uses[0]
                self._chunks.read_into(index, region(shard_index, position, piece.length), parallel=parallel)
            else:
                data = memoryview(self._chunks.read(index, parallel=parallel))
                for shard_index, position, piece in uses:
                    region(shard_index, position, piece.length)[:] = data[piece.offset : piece.offset + piece.length]
            for shard_index, _, _ in uses:
                waiting[shard_index] -= 1
                if not whole and not waiting[shard_index]:
                    shard = entry.shards[shard_index]
                    tensor[tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.shape))] = buffers.pop(
                        shard_index
                    )
        return tensor


def _overlapping(shards: tuple[ShardEntry, ...] | ShardGrid, offsets: tuple[int, ...], shape: tuple[int, ...]):
    """The shards a box may overlap: a grid's are found by a search per dimension, no object per cell."""
    if isinstance(shards, ShardGrid):
        return [shards[cell] for cell in shards.overlapping(offsets, shape).tolist()]
    return shards


def _uses_by_chunk(entry: TensorEntry) -> dict[int, list[tuple[int, int, Piece]]]:
    """Every piece of a tensor as (shard index, byte position in the shard, piece), grouped by chunk."""
    uses: dict[int, list[tuple[int, int, Piece]]] = {}
    for shard_index, shard in enumerate(entry.shards):
        position = 0
        for piece in shard.pieces:
            uses.setdefault(piece.chunk, []).append((shard_index, position, piece))
            position += piece.length
    return uses


def open(url: str | os.PathLike, *, storage_options: dict | None = None,
         map_location: str | torch.device | None = "cpu", mmap: bool = True,
         heal_from: HealFrom = None, trusted_keys: TrustedKeys = None, verify: VerifyMode = True) -> CheckpointReader:
    """Open a checkpoint (or a repository's latest) for lazy reads. See ``load`` for ``mmap``,
    ``heal_from``, ``trusted_keys`` and ``verify``."""
    return CheckpointReader(url, storage_options=storage_options, map_location=map_location, mmap=mmap,
                            heal_from=heal_from, trusted_keys=trusted_keys, verify=verify)


def load(url: str | os.PathLike, *, map_location: str | torch.device | None = "cpu",
         storage_options: dict | None = None, mmap: bool = True, into: Any = None, strict: bool = True,
         heal_from: HealFrom = None, trusted_keys: TrustedKeys = None, verify: VerifyMode = True) -> Any:
    """Load a checkpoint's whole state, type-exact, with every chunk verified against its hash.

    On local disks, tensors that lie whole in one uncompressed chunk are, by
    default (``mmap=True``), copy-on-write views of the memory-mapped chunk
    file, verified when mapped: no copy into fresh memory, as
    ``torch.load(mmap=True)`` does. Writes to them stay private to the process.
    ``mmap=False`` reads every tensor into memory of its own.

    ``into=state`` fills ``state`` in place instead and returns it: each tensor
    gets its saved value (a DTensor its own shard, at any world size or mesh),
    plain values are replaced, an object with ``state_dict()``/``load_state_dict()``
    (a module, an optimizer, a scheduler, ...: ``{"model": model, "optim": optim}``)
    gets its state back in place, a fresh optimizer its moments, and a value saved as
    ``PerRank`` becomes a ``PerRank`` of this rank's own, so the next save keeps every
    rank's. Missing or unexpected entries, shape or dtype mismatches, values a load
    cannot fill and ranks a ``PerRank`` value was not saved for raise a
    ``StateMismatchError`` listing them before anything changes; ``strict=False``
    loads what matches and warns with the rest (a rank without a saved value keeps its
    own).

    ``heal_from``: other repositories holding copies (slower tiers, replicas: URLs or
    ``Repository`` objects). A chunk missing or damaged here is read from the first
    that has a good copy, with a warning, and this copy is repaired in the background
    (done when ``load`` returns); with no good copy anywhere, the error names the
    tensor, the chunk and every place looked at.

    ``trusted_keys``: public keys (``.pub`` files of ``ckptfmt keygen``: Ed25519, ML-DSA-65 or the hybrid of
    both; key objects); the checkpoint is read only if one of them signed it (spec 10.3), else SignatureError
    names it (unsigned, signed by other keys, or a signature that does not verify: forged or damaged; for a
    hybrid key, both its signatures must verify).

    ``verify``: ``True`` (the default) hashes every chunk read; ``"once"`` skips a local chunk file that
    this process has already checked (by a ``verify``, a ``load`` or a read) and that is unchanged
    since (same inode, size, modification and change times: docs/usage.md says exactly what that
    trusts); ``False`` hashes nothing (sizes are still checked): damaged bytes then
    load without an error, a risk the caller takes for speed.
    """
    with open(url, storage_options=storage_options, map_location=map_location, mmap=mmap,
              heal_from=heal_from, trusted_keys=trusted_keys, verify=verify) as reader:
        if into is not None:
            rank, world_size = current_rank()
            state = load_into(reader, into, strict=strict, rank=rank, world_size=world_size, keep_per_rank=True)
            # the live tensors are sampled themselves: what the resume's check must vouch for
            remember_load(reader.commit.manifest_hash, reader.manifest, state)
        else:
            state = reader.load_state(remember=True)
            remember_fingerprints(reader.commit.manifest_hash, reader.manifest, reader.fingerprints)
        return state


def restore_rng(url_or_reader: str | os.PathLike | CheckpointReader, *, rank: int | None = None,
                storage_options: dict | None = None, trusted_keys: TrustedKeys = None) -> None:
    """Restore the torch, CUDA, numpy and Python RNG states rank ``rank`` (default: this rank) had at save.

    Resuming at another world size, a rank the checkpoint has no state for gets
    an error naming the ranks it has; with fewer ranks than saved, a warning
    says which saved states no rank restores. ``trusted_keys``: as ``load``'s.
    """
    reader = url_or_reader if isinstance(url_or_reader, CheckpointReader) else open(
        url_or_reader, storage_options=storage_options, trusted_keys=trusted_keys
    )
    this_rank, world_size = current_rank()
    rank = this_rank if rank is None else rank
    saved = sorted({e["rank"] for e in reader.manifest.rng if isinstance(e, dict) and type(e.get("rank")) is int})
    entries = [e for e in reader.manifest.rng if e.get("rank") == rank]
    if not entries:
        raise CheckpointNotFoundError(
            f"{reader.url}: no RNG state recorded for rank {rank}; the checkpoint has states for "
            f"{_ranks_text(saved) if saved else 'no rank'}"
        )
    unused = [r for r in saved if r >= world_size]
    if unused and rank == this_rank == 0:
        warnings.warn(f"{reader.url}: saved with RNG states for {_ranks_text(saved)}; resuming on {world_size} "
                      f"rank(s), the states of {_ranks_text(unused)} are not restored", CheckpointWarning,
                      stacklevel=2)
    apply_rng(entries[0], reader.url)


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return (
        ("rank " if len(ranks) == 1 else "ranks ")
        + ", ".join(map(str, ranks[:16]))
        + (", ..." if len(ranks) > 16 else "")
    )


class _Unread(int):
    """A tensor's index in the table, standing for the tensor while ``load_state`` picks what to read."""


def _unread_indices(value: Any) -> set[int]:
    """The tensor indices in a value tree decoded with ``_Unread`` for its tensors."""
    if isinstance(value, _Unread):
        return {int(value)}
    if isinstance(value, dict):
        return set().union(*map(_unread_indices, value.values()))
    if isinstance(value, (list, tuple, set, frozenset)):
        return set().union(*map(_unread_indices, value))
    return set()
