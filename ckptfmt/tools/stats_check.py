"""``verify --stats``: each tensor's recorded statistics (spec 6.10) recomputed from its verified bytes.

verify reads and hashes every distinct chunk once; ``StatsCheck`` takes the
statistics of every piece of a chunk as verify holds its bytes, then merges
each tensor's pieces and compares the result with what its manifest records.
A piece that does not hold whole elements (another writer may cut chunks
anywhere) is left to ``finish``, which streams that tensor's shards through
the chunk reader, carrying a partial element from one piece to the next.

Counts, extremes and ``absmax`` must be equal; ``mean`` and ``l2`` may differ by
float64 rounding, which depends on how the elements were summed (the writer's
blocks are not these): ``mean`` within 1e-9 of ``absmax`` (each element is at
most ``absmax`` away from zero, so rounding moves the mean by far less), ``l2``
within a relative 1e-9.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptfmt.errors import CheckpointError
from ckptfmt.format.chunk_table import stored_key
from ckptfmt.format.dtypes import itemsize
from ckptfmt.format.manifest import Manifest, TensorEntry
from ckptfmt.format.tensor_stats import merge_stats
from ckptfmt.loading.chunkio import ChunkReader
from ckptfmt.repository.repository import Repository
from ckptfmt.tensors.dtypes import DTYPES
from ckptfmt.tensors.stats import StatsAccumulator

#: How far float64 sums of the same elements in another order may drift (see the module's docstring).
ROUNDING = 1e-9

#: A piece's statistics are keyed by where its bytes are and how they are read:
#: (chunk key, offset, length, dtype name).
PartKey = tuple[str, int, int, str]


@dataclass(frozen=True)
class Disagreement:
    """A tensor whose recorded statistics are not those of its bytes."""

    checkpoint: str
    tensor: str
    #: field -> (recorded, recomputed)
    fields: dict[str, tuple[Any, Any]]

    @property
    def message(self) -> str:
        shown = ", ".join(f"{name} recorded {recorded!r}, bytes give {actual!r}"
                          for name, (recorded, actual) in self.fields.items())
        return f"statistics disagree with the stored bytes: {shown}"


class StatsCheck:
    """The statistics check of one verify run: ``plan``, then ``measure`` per verified chunk, then
    ``finish``."""

    def __init__(self, manifests: dict[str, Manifest]):
        #: Per chunk (hash, codec), the pieces to measure in it.
        self.parts: dict[str, set[PartKey]] = {}
        #: (checkpoint, tensor) -> the part keys of its pieces, shard by shard
        self.tensors: dict[tuple[str, int], list[PartKey]] = {}
        #: Tensors whose pieces do not hold whole elements: measured by ``finish``.
        self.streamed: list[tuple[str, int]] = []
        self.measured: dict[PartKey, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.manifests = manifests
        for name, manifest in manifests.items():
            for index, tensor in enumerate(manifest.tensors):
                if tensor.stats is not None and tensor.same_as is None and tensor.dtype in DTYPES:
                    self._plan(name, manifest, index, tensor)

    def _plan(self, name: str, manifest: Manifest, index: int, tensor: TensorEntry) -> None:
        width = itemsize(tensor.dtype)
        keys = []
        for shard in tensor.shards:
            for piece in shard.pieces:
                if piece.length % width:  # an element split between two pieces
                    self.streamed.append((name, index))
                    return
                chunk = manifest.chunks[piece.chunk]
                keys.append((stored_key(manifest.chunks, chunk), piece.offset, piece.length, tensor.dtype))
        self.tensors[(name, index)] = keys
        for key in keys:
            self.parts.setdefault(key[0], set()).add(key)

    def measure(self, ident: str, data: memoryview) -> None:
        """Take the statistics of every planned piece of chunk ``ident``, whose verified bytes are ``data``."""
        wanted = self.parts.get(ident)
        if not wanted:
            return
        if data.readonly:  # a decoded chunk's bytes: torch views writable memory only
            data = memoryview(bytearray(data))
        whole = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
        found = {key: _stats(DTYPES[key[3]], whole[key[1]:key[1] + key[2]]) for key in wanted}
        with self.lock:
            self.measured.update(found)

    def finish(self, repo: Repository) -> list[Disagreement]:
        """Every tensor whose bytes were all verified and whose statistics disagree with its record."""
        found = []
        for (name, index), keys in self.tensors.items():
            if all(key in self.measured for key in keys):  # else a damaged chunk, reported already
                tensor = self.manifests[name].tensors[index]
                parts = [self.measured[key] for key in keys] or [StatsAccumulator(DTYPES[tensor.dtype]).result()]
                found += self._compare(name, tensor, merge_stats(parts))
        for name, index in self.streamed:
            manifest = self.manifests[name]
            try:
                actual = _streamed_stats(repo, manifest, manifest.tensors[index])
            except CheckpointError:  # damaged: reported by the chunk check
                continue
            found += self._compare(name, manifest.tensors[index], actual)
        return found

    @staticmethod
    def _compare(name: str, tensor: TensorEntry, actual: Mapping[str, Any]) -> list[Disagreement]:
        recorded = tensor.stats or {}
        differing = {field: (recorded.get(field), value) for field, value in actual.items()
                     if not _agree(field, recorded.get(field), value, actual)}
        return [Disagreement(name, tensor.key, differing)] if differing else []


def _agree(field: str, recorded: Any, actual: Any, stats: Mapping[str, Any]) -> bool:
    if recorded is None or actual is None:
        return recorded is None and actual is None
    if isinstance(recorded, bool) or not isinstance(recorded, (int, float)):
        return False
    if field == "l2":
        return math.isclose(recorded, actual, rel_tol=ROUNDING)
    if field == "mean":
        return abs(recorded - actual) <= ROUNDING * (stats.get("absmax") or 0.0)
    return recorded == actual


def _stats(dtype: torch.dtype, data: torch.Tensor) -> dict[str, Any]:
    accumulator = StatsAccumulator(dtype)
    for start in range(0, data.numel(), _BLOCK):
        accumulator.add_bytes(data[start:start + _BLOCK])
    return accumulator.result()


_BLOCK = 2**20


def _streamed_stats(repo: Repository, manifest: Manifest, tensor: TensorEntry) -> dict[str, Any]:
    """The statistics of a tensor whose pieces split elements: each shard's bytes streamed through a
    carry of the partial element, one chunk in memory at a time."""
    dtype, width = DTYPES[tensor.dtype], itemsize(tensor.dtype)
    reader = ChunkReader(repo.storage, manifest.chunks)
    accumulator = StatsAccumulator(dtype)
    for shard in tensor.shards:
        carry = b""
        for piece in shard.pieces:
            data = carry + bytes(memoryview(reader.read(piece.chunk))[piece.offset:piece.offset + piece.length])
            whole = len(data) - len(data) % width
            if whole:
                accumulator.add_bytes(torch.frombuffer(bytearray(data[:whole]), dtype=torch.uint8))
            carry = data[whole:]
    return accumulator.result()
