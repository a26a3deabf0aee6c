"""The manifest's chunk table and tensor table from what the writing ranks stored: one builder for every
save, the pipeline's coordinator and the DCP storage writer's ``finish`` alike.

Each writer reports its own chunk table (``StoredSources.chunks``: its chunks, and the parent's chunks
its deltas are stored against, each delta's ``base`` a row of that table) and each source's pieces in
it. ``ManifestTables`` takes every writer's table into one (a chunk two writers stored keeps one row)
and turns each writer's pieces into rows of it; ``tensor_entry`` makes a tensor's row from its shards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckptfmt.format.manifest import Chunk, Piece, ShardEntry, TensorEntry
from ckptfmt.format.tensor_stats import merge_stats
from ckptfmt.saving.chunk_writer import ChunkTable


class ManifestTables:
    """The chunk table being built from every writer's, and the pieces of each writer's sources."""

    def __init__(self):
        self.chunks = ChunkTable()
        self._rows: list[list[int]] = []
        #: Per writer, whether its rows are the same rows of the merged table (its pieces stand as they are).
        self._same: list[bool] = []

    def add_writer(self, chunks: Sequence[Chunk], written_rows: frozenset[int] | set[int]) -> int:
        """Take a writer's chunk table (``written_rows``: the rows it stored, not found stored); returns
        the writer's number for ``pieces``."""
        table = list(chunks)
        rows = [self.chunks.add_with_bases(chunk, table, row in written_rows) for row, chunk in enumerate(table)]
        self._rows.append(rows)
        self._same.append(rows == list(range(len(rows))))  # its rows are the merged table's (one writer)
        return len(self._rows) - 1

    def rows(self, writer: int) -> list[int]:
        """The rows of the merged table that a writer's chunks are."""
        return self._rows[writer]

    def pieces(self, writer: int, pieces: Sequence[Piece]) -> tuple[Piece, ...]:
        """A writer's pieces of one source, pointing at rows of the merged table."""
        if self._same[writer]:
            return tuple(pieces)
        rows = self._rows[writer]
        return tuple(Piece(rows[piece.chunk], piece.offset, piece.length) for piece in pieces)


def tensor_entry(key: str, dtype: str, shape: tuple[int, ...], shards: Sequence[tuple[ShardEntry, Mapping | None]], *,
                 kind: str = "tensor", requires_grad: bool = False, same_as: int | None = None) -> TensorEntry:
    """A tensor's row: its shards (each with its statistics), in offset order, and its statistics merged
    from theirs (none on a ``same_as`` entry, whose data is another's)."""
    if len(shards) == 1:  # the usual entry: its shard's statistics are the tensor's
        (shard, stats), = shards
        return TensorEntry(key, dtype, tuple(shape), (shard,), kind, requires_grad, same_as,
                           None if same_as is not None else stats)
    ordered = sorted(shards, key=lambda shard: shard[0].offsets)
    return TensorEntry(key=key, dtype=dtype, shape=tuple(shape), shards=tuple(shard for shard, _ in ordered),
                       kind=kind, requires_grad=requires_grad, same_as=same_as,
                       stats=None if same_as is not None else merged_stats([stats for _, stats in ordered]))


def merged_stats(parts: Sequence[Mapping | None]) -> Mapping | None:
    """A tensor's statistics from its shards' (spec 6.10), or None when any shard has none."""
    if not parts or any(part is None for part in parts):
        return None
    return merge_stats(parts)  # type: ignore[arg-type]
