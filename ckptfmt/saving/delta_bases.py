"""Where a save finds the base of a delta chunk: the same tensor region in the parent checkpoint.

``compression="delta-zstd"`` (and ``"auto"``) stores a chunk as its XOR against the chunk that held
the same bytes of the same tensor in the parent (same key, dtype and shape, one shard, the region
cut at the same place). Chains are bounded: a chunk whose base is already ``MAX_CHAIN`` deltas deep
is stored whole, so a reader decodes at most that many bases (the format allows up to
``MAX_DELTA_DEPTH``).
"""

from __future__ import annotations

from ckptfmt.format.manifest import Chunk, Manifest, delta_depth
from ckptfmt.loading.chunkio import ChunkReader
from ckptfmt.repository.repository import Repository

#: Deltas a writer stacks on a chunk stored whole before it stores one whole again.
MAX_CHAIN = 8


class DeltaBases:
    """The parent's chunk for each region of this save's sources, and its decoded bytes on demand."""

    def __init__(self, repo: Repository, parent: Manifest, entries: list[dict]):
        self.table: list[Chunk] = list(parent.chunks)
        self._reader = ChunkReader(repo.storage, self.table)
        #: (source index, byte start, length) -> the parent's chunk row holding exactly those bytes.
        self._regions: dict[tuple[int, int, int], int] = {}
        previous = {t.key: t for t in parent.tensors if t.same_as is None and len(t.shards) == 1}
        for entry in entries:
            old = previous.get(entry["key"])
            if (old is None or entry["same_as"] is not None or len(entry["shards"]) != 1
                    or old.dtype != entry["dtype"] or tuple(old.shape) != tuple(entry["shape"])):
                continue
            source = entry["shards"][0][0]
            position = 0
            for piece in old.shards[0].pieces:
                if piece.offset == 0 and piece.length == self.table[piece.chunk].size:
                    self._regions[(source, position, piece.length)] = piece.chunk
                position += piece.length

    def base_for(self, source: int, start: int, length: int) -> int | None:
        """The parent's row for a region, if a delta may be stored against it (its chain not too deep)."""
        row = self._regions.get((source, start, length))
        if row is None or delta_depth(self.table, row) >= MAX_CHAIN:
            return None
        return row

    def read(self, row: int) -> bytes | memoryview:
        """The decoded, verified bytes of the parent's chunk ``row``."""
        return self._reader.read(row)
