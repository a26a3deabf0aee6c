"""Where a save finds the base of a delta chunk: the same tensor region in the parent checkpoint.

``compression="delta-zstd"`` (and ``"auto"``) stores a chunk as its XOR against the chunk that held
the same bytes of the same tensor in the parent (same key, dtype and shape, the same box of it, the
region cut at the same place), in single-process and collective saves alike. Chains are bounded: a
chunk whose base is already ``MAX_CHAIN`` deltas deep is stored whole, so a reader decodes at most
that many bases (the format allows up to ``MAX_DELTA_DEPTH``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptfmt.format.chunk_table import delta_depth
from ckptfmt.format.manifest import Chunk, Manifest
from ckptfmt.loading.chunkio import ChunkReader
from ckptfmt.repository.repository import Repository
from ckptfmt.saving.plan import PlannedTensor

#: Deltas a writer stacks on a chunk stored whole before it stores one whole again.
MAX_CHAIN = 8


@dataclass(frozen=True)
class Region:
    """Where the bytes of one source of this save lie: a box of a tensor (key, dtype and global shape),
    starting at ``offsets``, of ``shape``."""

    key: str
    dtype: str
    tensor_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


class DeltaBases:
    """The parent's chunk for each region of this save's sources, and its decoded bytes on demand.

    A source's base is the parent's chunk that held the same bytes of the same box of the same tensor:
    the same key, dtype and global shape, a shard at the same offsets of the same shape, cut into chunks
    at the same places. Whole tensors and the shards of sharded ones alike, on one rank or many.
    """

    def __init__(self, repo: Repository, parent: Manifest, regions: list[Region | None]):
        """``regions``: what each source (by index, as the chunk writer numbers them) holds; None for none."""
        self.table: list[Chunk] = list(parent.chunks)
        self._reader = ChunkReader(repo.storage, self.table)
        #: (source index, byte start, length) -> the parent's chunk row holding exactly those bytes.
        self._regions: dict[tuple[int, int, int], int] = {}
        previous = {t.key: t for t in parent.tensors if t.same_as is None}
        for source, region in enumerate(regions):
            if region is None:
                continue
            old = previous.get(region.key)
            if old is None or old.dtype != region.dtype or tuple(old.shape) != region.tensor_shape:
                continue
            shard = next((s for s in old.shards if tuple(s.offsets) == region.offsets
                          and tuple(s.shape) == region.shape), None)
            if shard is None:
                continue
            position = 0
            for piece in shard.pieces:
                if piece.offset == 0 and piece.length == self.table[piece.chunk].size:
                    self._regions[(source, position, piece.length)] = piece.chunk
                position += piece.length

    @classmethod
    def for_entries(cls, repo: Repository, parent: Manifest, entries: list[PlannedTensor],
                    shapes: list[tuple[int, ...]], sources: list[int] | None = None) -> DeltaBases:
        """The bases of the sources of a rank's ``entries`` (``shapes``: each source's box shape);
        ``sources``: the indices of the sources this rank writes, in the order it writes them (all)."""
        held: dict[int, Region] = {}
        for entry in entries:
            if entry.same_as is not None:
                continue
            for box in entry.boxes:
                held[box.source] = Region(entry.key, entry.dtype, tuple(entry.shape), tuple(box.offsets),
                                          tuple(shapes[box.source]))
        order = range(len(shapes)) if sources is None else sources
        return cls(repo, parent, [held.get(index) for index in order])

    def base_for(self, source: int, start: int, length: int) -> int | None:
        """The parent's row for a region, if a delta may be stored against it (its chain not too deep)."""
        row = self._regions.get((source, start, length))
        if row is None or delta_depth(self.table, row) >= MAX_CHAIN:
            return None
        return row

    def read(self, row: int) -> bytes | memoryview:
        """The decoded, verified bytes of the parent's chunk ``row``."""
        return self._reader.read(row)
