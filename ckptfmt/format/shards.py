"""A tensor's shards and their pieces: one map per shard, or a grid of packed columns (spec 6.5, 6.11).

A checkpoint saved on many ranks has millions of shards. As msgpack maps they
cost 50 bytes each and a Python object apiece to read. A ``ShardGrid`` keeps a
tensor's shards as the cells of a grid (a column of cuts per dimension) with
little-endian integer columns for the cells' ranks and pieces: about 10 bytes a shard
for a row-sharded tensor, validated with a few numpy operations per tensor,
and read (the resharding planner, ``show``, ``verify``) without one object per
shard. It is a sequence of ``ShardEntry`` for code that wants them one by one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from ckptfmt.errors import ManifestError
from ckptfmt.format.limits import MAX_CHUNK_BYTES, MAX_SHARDS_PER_TENSOR

if TYPE_CHECKING:  # numpy is imported where it is used: not to list or describe a checkpoint
    import numpy as np

#: The greatest shard ``rank`` (spec 6.5).
MAX_RANK = 2**31 - 1
_WIDTHS = (1, 2, 4, 8)
_MAX_INT64 = 2**63 - 1


class Piece(NamedTuple):
    """A byte range of one chunk; a shard's pieces, concatenated, are its C-order bytes."""

    chunk: int
    offset: int
    length: int


class ShardEntry(NamedTuple):
    """A shard's row in the tensor table (spec 6.5): where its box starts in the global tensor, its
    shape, who wrote it, its pieces. (``ckptfmt.Shard`` is what a state hands a save: a box's data.)"""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    rank: int
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ShardGrid(Sequence[ShardEntry]):
    """A tensor's shards as the cells of a grid, in C order over the cells (spec 6.11).

    ``cuts[k]`` are dimension k's boundaries (0 first, the tensor's extent last,
    never decreasing); cell ``i``'s pieces are rows ``starts[i]:starts[i + 1]``
    of the piece columns ``chunk``, ``offset`` and ``length``.
    """

    __slots__ = ("cuts", "ranks", "_starts", "chunk", "offset", "length", "cells")

    def __init__(self, cuts: Sequence[np.ndarray], ranks: np.ndarray, starts: np.ndarray | None,
                 chunk: np.ndarray, offset: np.ndarray, length: np.ndarray):
        """``starts`` None: each cell has exactly one piece (row ``i`` is cell ``i``'s)."""
        self.cuts = tuple(cuts)
        self.cells = tuple(len(c) - 1 for c in self.cuts)
        self.ranks, self._starts = ranks, starts
        self.chunk, self.offset, self.length = chunk, offset, length

    @property
    def starts(self) -> np.ndarray:
        """Cell ``i``'s pieces are rows ``starts[i]:starts[i + 1]`` of the piece columns."""
        import numpy as np

        if self._starts is None:
            self._starts = np.arange(len(self.ranks) + 1, dtype=np.int64)
        return self._starts

    def __len__(self) -> int:
        return len(self.ranks)

    def __getitem__(self, index):
        import numpy as np

        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        count = len(self)
        if not -count <= index < count:
            raise IndexError("shard index out of range")
        index %= count
        coords = np.unravel_index(index, self.cells) if self.cells else ()
        low = [int(c[j]) for c, j in zip(self.cuts, coords)]
        high = [int(c[j + 1]) for c, j in zip(self.cuts, coords)]
        first, last = int(self.starts[index]), int(self.starts[index + 1])
        pieces = tuple(map(Piece._make, zip(self.chunk[first:last].tolist(), self.offset[first:last].tolist(),
                                            self.length[first:last].tolist())))
        return ShardEntry(tuple(low), tuple(h - lo for lo, h in zip(low, high)), int(self.ranks[index]), pieces)

    def __iter__(self) -> Iterator[ShardEntry]:
        return (self[i] for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (ShardGrid, tuple, list)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ShardGrid(cells={list(self.cells)}, pieces={len(self.chunk)})"

    def overlapping(self, offsets: Sequence[int], shape: Sequence[int]) -> np.ndarray:
        """The cells that hold elements of the box at ``offsets`` of ``shape``: a search per dimension.

        This is how a resharding load plans its reads: the cost is that of the
        cells it reads, not of the grid.
        """
        import numpy as np

        index = np.zeros(1, dtype=np.int64)
        for cuts, count, start, size in zip(self.cuts, self.cells, offsets, shape):
            if size <= 0:
                return np.empty(0, dtype=np.int64)
            if count == 1:  # a dimension not cut: its one interval holds the box
                continue
            # Cells j with cuts[j] < start + size and cuts[j + 1] > start, empty ones left out.
            first = int(cuts.searchsorted(start, side="right")) - 1
            last = int(cuts.searchsorted(start + size, side="left"))
            cells = np.arange(max(first, 0), min(last, count))
            cells = cells[cuts[cells + 1] > cuts[cells]]
            index = np.add.outer(index * count, cells).ravel()
        return index


class _Budget(Protocol):
    def take(self, shards: int, pieces: int) -> None: ...


# -- the wire form (spec 6.11) -------------------------------------------------

def grid_of(shape: tuple[int, ...], shards: Sequence[ShardEntry]) -> ShardGrid | None:
    """``shards`` as a grid when those holding elements are exactly its cells (each dimension's
    distinct intervals chaining from 0 to the extent), else None: a writer then keeps one map per
    shard. Empty shards are left out of a grid: ranks that held nothing of an uneven split."""
    import numpy as np

    shards = [s for s in shards if math.prod(s.shape)]
    if len(shards) < 2 or not shape:
        return None
    intervals = []
    for dim, extent in enumerate(shape):
        pairs = sorted({(s.offsets[dim], s.offsets[dim] + s.shape[dim]) for s in shards})
        if pairs[0][0] != 0 or pairs[-1][1] != extent or any(a[1] != b[0] for a, b in zip(pairs, pairs[1:])):
            return None
        intervals.append(pairs)
    cells = tuple(len(pairs) for pairs in intervals)
    if math.prod(cells) != len(shards):
        return None
    where = [{start: j for j, (start, _) in enumerate(pairs)} for pairs in intervals]
    order: list[ShardEntry | None] = [None] * len(shards)
    for shard in shards:
        coords = []
        for dim, lookup in enumerate(where):
            j = lookup[shard.offsets[dim]]
            if intervals[dim][j][1] != shard.offsets[dim] + shard.shape[dim]:
                return None  # two intervals of one start: not a grid
            coords.append(j)
        cell = int(np.ravel_multi_index(coords, cells))
        if order[cell] is not None:
            return None
        order[cell] = shard
    cuts = [np.array([0] + [end for _, end in pairs], dtype=np.int64) for pairs in intervals]
    counts = [len(s.pieces) for s in order]  # type: ignore[union-attr]
    pieces = [p for s in order for p in s.pieces]  # type: ignore[union-attr]
    columns = np.array(pieces, dtype=np.int64).reshape(-1, 3)
    return ShardGrid(cuts, np.array([s.rank for s in order], dtype=np.int64),  # type: ignore[union-attr]
                     np.concatenate(([0], np.cumsum(counts))).astype(np.int64),
                     columns[:, 0], columns[:, 1], columns[:, 2])


def grid_to_dict(grid: ShardGrid, width: int) -> dict:
    """The grid's map (spec 6.11): columns packed in the narrowest width, defaults left out."""
    import numpy as np

    doc: dict[str, Any] = {"cells": list(grid.cells), "cuts": [pack_column(c) for c in grid.cuts]}
    if np.any(grid.ranks):
        doc["ranks"] = pack_column(grid.ranks)
    if pieces_are_cells(grid, width):
        doc.update(chunk=pack_column(grid.chunk), offset=pack_column(grid.offset))
    else:
        doc.update(counts=pack_column(np.diff(grid.starts)), chunk=pack_column(grid.chunk),
                   offset=pack_column(grid.offset), length=pack_column(grid.length))
    return doc


def pieces_are_cells(grid: ShardGrid, width: int) -> bool:
    """Whether each cell of ``grid`` that holds elements has one piece of its whole bytes, and the others
    none: the form whose ``counts`` and ``length`` a writer leaves out (spec 6.11)."""
    import numpy as np

    counts = np.diff(grid.starts)
    bytes_ = cell_volumes(grid.cuts, grid.cells, tuple(int(c[-1]) for c in grid.cuts)) * width
    return bool(np.array_equal(counts, (bytes_ > 0).astype(counts.dtype))
                and np.array_equal(grid.length, bytes_[bytes_ > 0]))


def pack_column(values: np.ndarray) -> bytes:
    """Unsigned little-endian integers of the narrowest of 1, 2, 4 or 8 bytes that holds them all."""
    import numpy as np

    top = int(values.max()) if len(values) else 0
    width = next(w for w in _WIDTHS if top < 1 << (8 * w))
    return np.ascontiguousarray(values, dtype=f"<u{width}").tobytes()


def parse_grid(doc: dict, what: str, shape: tuple[int, ...], width: int, chunk_sizes: np.ndarray,
               budget: _Budget) -> ShardGrid:
    """Check a shard grid's map against its tensor and the chunk table (spec 6.11, 14), whole
    columns at a time: its cost is that of its bytes, whatever it claims, and about 20 numpy
    operations for the usual grid (one dimension split, a piece a cell)."""
    import numpy as np

    per_dim, raw_cuts = doc.get("cells"), doc.get("cuts")
    if (type(per_dim) is not list or len(per_dim) != len(shape)
            or not set(map(type, per_dim)) <= {int} or (shape and min(per_dim) < 1)):
        raise ManifestError(f"{what}: shard grid cells must be {len(shape)} integers >= 1, one per dimension")
    cells = math.prod(per_dim)
    if cells > MAX_SHARDS_PER_TENSOR:
        raise ManifestError(f"{what}: shard grid of {cells} cells is over the {MAX_SHARDS_PER_TENSOR} limit")
    if type(raw_cuts) is not list or len(raw_cuts) != len(shape):
        raise ManifestError(f"{what}: shard grid cuts must be a list of {len(shape)} bins, one per dimension")
    budget.take(cells, 0)
    cuts = [_cuts(raw, count + 1, extent, f"cuts[{dim}]", what)
            for dim, (raw, count, extent) in enumerate(zip(raw_cuts, per_dim, shape))]
    volumes = cell_volumes(cuts, per_dim, shape)
    ranks = column(doc.get("ranks"), "ranks", cells, what, high=MAX_RANK) if "ranks" in doc else None
    starts: np.ndarray | None = None
    if "counts" in doc:
        counts = column(doc.get("counts"), "counts", cells, what, high=MAX_CHUNK_BYTES)
        total = int(counts.sum(dtype=np.int64))
        budget.take(0, total)
        starts = np.zeros(cells + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        length = column(doc.get("length"), "length", total, what, low=1, high=MAX_CHUNK_BYTES)
        ends = np.zeros(total + 1, dtype=np.int64)
        np.cumsum(length, out=ends[1:])
        held = ends[starts[1:]] - ends[starts[:-1]]
        wrong = np.flatnonzero(held != volumes * width)
        if len(wrong):
            cell = int(wrong[0])
            raise ManifestError(f"{what}: shard grid cell {cell} needs {int(volumes[cell]) * width} bytes, "
                                f"its pieces hold {int(held[cell])}")
    elif "length" in doc:
        raise ManifestError(f"{what}: shard grid has lengths but no counts")
    elif volumes.min() > 0:  # the usual grid: a piece a cell
        total = cells
        budget.take(0, total)
        length = volumes * width
    else:
        solid = volumes > 0
        total = int(np.count_nonzero(solid))
        budget.take(0, total)
        starts = np.zeros(cells + 1, dtype=np.int64)
        np.cumsum(solid, out=starts[1:])
        length = volumes[solid] * width
    chunk = column(doc.get("chunk"), "chunk", total, what, high=len(chunk_sizes) - 1)
    offset = column(doc.get("offset"), "offset", total, what, high=MAX_CHUNK_BYTES)
    if total:
        over = offset + length > chunk_sizes[chunk]
        if over.any():
            row = int(np.argmax(over))
            raise ManifestError(f"{what}: piece [{int(offset[row])}, +{int(length[row])}) runs past chunk "
                                f"{int(chunk[row])} ({int(chunk_sizes[chunk[row]])} bytes)")
    return ShardGrid(cuts, ranks if ranks is not None else np.zeros(cells, dtype=np.uint8), starts,
                     chunk, offset, length)


#: The fields of a grid of the usual form (no ``counts`` or ``length``: a piece a cell).
_USUAL_GRID_FIELDS = frozenset({"cells", "cuts", "ranks", "chunk", "offset"})
#: Cells of usual grids checked together: a few hundred KiB of columns, in cache (2 M cells at once were
#: fresh pages, slower than a grid at a time).
_BATCH_CELLS = 1 << 15


def parse_usual_grids(items: Sequence[tuple[dict, tuple[int, ...], int]], chunk_sizes: np.ndarray,
                      most_cells: int = _MAX_INT64) -> list[ShardGrid | None]:
    """The grids of ``items`` (a grid's map, its tensor's shape and element width) that have the usual
    form (at most one dimension cut, every cell holding elements, a piece a cell), checked together:
    each check of ``parse_grid`` is one numpy operation over many grids' columns rather than some 20
    per grid, which were most of the parse of a manifest of thousands of tensors sharded over a
    thousand ranks. None for a grid of another form, and for every grid of a batch where one fails
    a check: ``parse_grid`` then takes each alone and names the fault. Grids past ``most_cells`` cells
    in all (what the manifest's budget has left) are left alone too: their parse refuses the manifest
    before building them."""
    found: list[ShardGrid | None] = [None] * len(items)
    batch: list[int] = []
    usual: list[tuple] = []
    cells = taken = 0
    for index, (doc, shape, width) in enumerate(items):
        grid = _usual_grid(doc, shape, width)
        over = grid is not None and taken + grid[1] > most_cells
        if grid is not None and not over:
            taken += grid[1]
            batch.append(index)
            usual.append(grid)
            cells += grid[1]
        if batch and (cells >= _BATCH_CELLS or over or index == len(items) - 1):  # batches stay in cache
            checked = _usual_batch(usual, [items[i][1] for i in batch], chunk_sizes)
            for at, checked_grid in zip(batch, checked or ()):
                found[at] = checked_grid
            batch, usual, cells = [], [], 0
        if over:  # this grid and those after it are left to be parsed alone
            break
    return found


def _usual_batch(usual: list[tuple], shapes: list[tuple[int, ...]], chunk_sizes: np.ndarray) -> list[ShardGrid] | None:
    """``parse_usual_grids``'s checks of some grids (``_usual_grid``'s tuples) at once."""
    import numpy as np

    dims, counts, scale, cut_columns, rank_columns, chunk_columns, offset_columns = zip(*usual)
    cells_at = np.zeros(len(usual) + 1, dtype=np.int64)
    np.cumsum(counts, out=cells_at[1:])
    extents = np.array([shape[dim] for shape, dim in zip(shapes, dims)], dtype=np.uint64)
    cuts = _usual_cuts(cut_columns, cells_at, extents)
    if cuts is None:
        return None
    # Cell c of grid g spans cuts[c + g] to cuts[c + g + 1]: each grid's cuts hold one value more than its cells.
    steps = np.diff(cuts)
    if len(usual) > 1:
        within = np.ones(len(steps), dtype=bool)
        within[cells_at[1:-1] + np.arange(len(usual) - 1)] = False  # a grid's last cut to the next one's first
        steps = steps[within]
    # Every step positive, from 0 to the extent: every cut within [0, extent] (checked before multiplying, so
    # that no product wraps: each is then at most the tensor's bytes).
    if (steps <= 0).any():
        return None
    if min(scale) == max(scale):  # the usual case: the tensors' uncut dimensions agree (a model's hidden size)
        length = steps * scale[0]
    else:
        per_cell = np.zeros(len(steps), dtype=np.int64)  # each cell's bytes per unit of its cut dimension
        per_cell[cells_at[:-1]] = np.diff(scale, prepend=0)
        length = steps * np.cumsum(per_cell, out=per_cell)
    chunk, offset = np.concatenate(chunk_columns), np.concatenate(offset_columns)
    ranks = [column for column in rank_columns if column is not None]
    if ((ranks and np.concatenate(ranks).max() > MAX_RANK)
            or offset.max() > MAX_CHUNK_BYTES or chunk.max() >= len(chunk_sizes)
            or (offset.astype(np.int64) + length > chunk_sizes[chunk]).any()):
        return None
    grids = []
    for index, (shape, dim, cells) in enumerate(zip(shapes, dims, counts)):
        first = int(cells_at[index])
        grid_cuts = [np.array([0, extent], dtype=np.int64) for extent in shape]
        grid_cuts[dim] = cuts[first + index:first + index + cells + 1]
        grids.append(ShardGrid(grid_cuts, _wide(rank_columns[index]) if rank_columns[index] is not None
                               else np.zeros(cells, dtype=np.uint8), None, _wide(chunk_columns[index]),
                               _wide(offset_columns[index]), length[first:first + cells]))
    return grids


def _usual_grid(doc: Any, shape: tuple[int, ...], width: int) -> tuple | None:
    """A grid of the usual form as (its cut dimension, cells, bytes a cell per unit of that dimension,
    and its cut, ranks, chunk and offset columns, read in place; ranks None where absent); a grid
    cut nowhere stands cut in dimension 0 into one cell. None for any other grid."""
    per_dim, raw_cuts = doc.get("cells"), doc.get("cuts")
    if (not shape or not _USUAL_GRID_FIELDS.issuperset(doc) or type(per_dim) is not list or type(raw_cuts)
            is not list or len(per_dim) != len(shape) or len(raw_cuts) != len(shape)):
        return None
    cut = None
    for dim, (count, raw, extent) in enumerate(zip(per_dim, raw_cuts, shape)):
        if type(count) is not int or count < 1 or type(raw) is not bytes:
            return None
        if count > 1:
            if cut is not None:
                return None
            cut = dim
        elif not _whole(raw, extent):
            return None
    dim = cut or 0
    cells = per_dim[dim]
    if cells > MAX_SHARDS_PER_TENSOR:
        return None
    columns = [_view(raw_cuts[dim], cells + 1), _view(doc["ranks"], cells) if "ranks" in doc else None,
               _view(doc.get("chunk"), cells), _view(doc.get("offset"), cells)]
    if columns[0] is None or columns[2] is None or columns[3] is None or (columns[1] is None and "ranks" in doc):
        return None
    bytes_per_unit = math.prod(extent for other, extent in enumerate(shape) if other != dim) * width
    return (dim, cells, bytes_per_unit, *columns)


def _whole(raw: bytes, extent: int) -> bool:
    """Whether ``raw`` is the cuts of a dimension not cut: [0, extent] in one width."""
    half = len(raw) // 2
    return len(raw) in (2, 4, 8, 16) and not int.from_bytes(raw[:half], "little") \
        and int.from_bytes(raw[half:], "little") == extent


def _view(raw: Any, count: int) -> np.ndarray | None:
    """A bin of ``count`` little-endian unsigned ints of one width, read in place; None if it is not."""
    import numpy as np

    if type(raw) is not bytes:
        return None
    width, rest = divmod(len(raw), count)
    return None if rest or width not in _WIDTHS else np.frombuffer(raw, dtype=_unsigned(width))


@functools.cache
def _unsigned(width: int) -> np.dtype:
    """The little-endian unsigned int dtype of ``width`` bytes (made once: parsing its name costs a
    microsecond a column)."""
    import numpy as np

    return np.dtype(f"<u{width}")


def _wide(column: np.ndarray) -> np.ndarray:
    """A column as ``column()`` gives it: in place, but 8-byte ints made int64."""
    import numpy as np

    return column.astype(np.int64) if column.itemsize == 8 else column


def _usual_cuts(columns: Sequence[np.ndarray], cells_at: np.ndarray, extents: np.ndarray) -> np.ndarray | None:
    """The grids' cut columns joined as int64 (grid i's at ``cells_at[i] + i``, one value more than its
    cells); None unless each runs from 0 to its extent."""
    import numpy as np

    joined = np.concatenate(columns)
    if joined.dtype == np.uint64 and joined.max() > _MAX_INT64:
        return None
    first = cells_at[:-1] + np.arange(len(columns))
    last = first + np.diff(cells_at)
    if joined[first].any() or (joined[last].astype(np.uint64) != extents).any():
        return None
    return joined.astype(np.int64)


def _cuts(raw: Any, count: int, extent: int, name: str, what: str) -> np.ndarray:
    """One dimension's boundaries: a column of ``count`` ints, 0 first, ``extent`` last, never decreasing."""
    import numpy as np

    if count == 2 and type(raw) is bytes and _whole(raw, extent):  # a dimension not split: [0, extent]
        return np.array([0, extent], dtype=np.int64)
    cuts = column(raw, name, count, what, high=extent).astype(np.int64)  # count values: a small copy
    if cuts[0] != 0 or cuts[-1] != extent or (count > 2 and np.diff(cuts).min() < 0):
        raise ManifestError(f"{what}: shard grid {name} must run from 0 to the extent {extent} "
                            "without decreasing")
    return cuts


def column(raw: Any, name: str, count: int, what: str, *, low: int = 0, high: int = _MAX_INT64,
           table: str = "shard grid") -> np.ndarray:
    """A column of ``count`` unsigned little-endian ints in [low, high]: a bin of count x w bytes,
    w in 1, 2, 4, 8 (spec 6.11, and the tensor columns of 6.12). Read in place, without a copy,
    except 8-byte ints (made int64)."""
    import numpy as np

    if type(raw) is not bytes:
        raise ManifestError(f"{what}: {table} column {name!r} must be a bin")
    if count == 0:
        if raw:
            raise ManifestError(f"{what}: {table} column {name!r} must be empty")
        return np.empty(0, dtype=np.int64)
    values = _view(raw, count)
    if values is None:
        raise ManifestError(f"{what}: {table} column {name!r} of {len(raw)} bytes does not hold {count} "
                            "integers of 1, 2, 4 or 8 bytes")
    if (low and values.min() < low) or (high < 256 ** values.itemsize - 1 and values.max() > high):
        raise ManifestError(f"{what}: {table} column {name!r} holds values outside [{low}, {high}]")
    return _wide(values)


def cell_volumes(cuts: Sequence[np.ndarray], per_dim: Sequence[int], shape: tuple[int, ...]) -> np.ndarray:
    """Every cell's element count, in C order (no overflow: each is at most the tensor's, or all are 0)."""
    import numpy as np

    if not all(shape):  # no element (its other extents may multiply out past int64)
        return np.zeros(math.prod(per_dim), dtype=np.int64)
    split = [dim for dim, count in enumerate(per_dim) if count > 1]
    if len(split) <= 1:  # the usual grid: one dimension cut, each cell spans the others whole
        rest = math.prod(extent for dim, extent in enumerate(shape) if dim not in split)
        if not split:
            return np.full(1, rest, dtype=np.int64)
        return np.diff(cuts[split[0]]) * rest if rest else np.zeros(per_dim[split[0]], dtype=np.int64)
    extents = [np.diff(c) for c in cuts]
    if any(not e.any() for e in extents):
        return np.zeros(math.prod(per_dim), dtype=np.int64)
    volumes = extents[0]
    for extent in extents[1:]:
        volumes = np.multiply.outer(volumes, extent).ravel()
    return volumes


def chunk_rows(shards: Sequence[ShardEntry] | ShardGrid) -> list[int]:
    """The chunk rows of a tensor's pieces, in order (with repeats), without a ShardEntry per grid cell."""
    if isinstance(shards, ShardGrid):
        return shards.chunk.tolist()
    return [piece.chunk for shard in shards for piece in shard.pieces]


def shard_ranks(shards: Sequence[ShardEntry] | ShardGrid) -> list[int]:
    """Each shard's owning rank, in order, without a ShardEntry per grid cell."""
    if isinstance(shards, ShardGrid):
        return shards.ranks.tolist()
    return [shard.rank for shard in shards]
