"""Shard grids in the tensor columns (spec 6.12, format 1.14): every grid of a table in five columns.

A collective save of 5,000 tensors over 4 ranks wrote each tensor's shard grid as
a map of its own (spec 6.11) in a row of the table, and a reader checked and built
each one in Python: about 20 us a tensor, 7x msgpack's own unpack of the bytes.
From 1.14 the grids of a table's entries lie back to back in the columns of its
``grids`` map, checked for all of them together by whole-column numpy
operations, each entry's ``ShardGrid`` made of views of the columns when the
entry is read. A grid whose pieces are not each a whole cell stays in a row.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ckptfmt.errors import ManifestError
from ckptfmt.format.dtypes import itemsize
from ckptfmt.format.limits import MAX_CHUNK_BYTES, MAX_SHARDS_PER_TENSOR
from ckptfmt.format.shards import MAX_RANK, ShardGrid, column, grid_of, pack_column, pieces_are_cells
from ckptfmt.format.tensor_entry import TensorEntry

if TYPE_CHECKING:
    import numpy as np

_MAX_DIM = 2**63 - 1
_WHAT = "tensor columns"


# -- writing -------------------------------------------------------------------------------------

def column_grid(tensor: TensorEntry) -> ShardGrid | None:
    """``tensor``'s shards as a grid the columns hold: the cells are its shards, each cell that holds
    elements has one piece of its whole bytes; no ``same_as``. None for any other entry."""
    if tensor.same_as is not None:
        return None
    shards = tensor.shards
    grid = shards if isinstance(shards, ShardGrid) else grid_of(tensor.shape, shards)
    return grid if grid is not None and pieces_are_cells(grid, itemsize(tensor.dtype)) else None


def grids_to_columns(grids: Sequence[ShardGrid]) -> dict:
    """The ``grids`` map of the tensor columns: ``grids``' columns joined in order, each in the narrowest
    width that holds its values; ``ranks`` left out when every cell's rank is 0."""
    import numpy as np

    def joined(arrays: list) -> np.ndarray:  # as int64 first: uint64 and int64 together would give floats
        return np.concatenate([np.asarray(a, dtype=np.int64) for a in arrays]) if arrays \
            else np.zeros(0, dtype=np.int64)

    ranks = joined([grid.ranks for grid in grids])
    doc = {"cells": pack_column(np.array([c for grid in grids for c in grid.cells], dtype=np.int64)),
           "cuts": pack_column(joined([cut for grid in grids for cut in grid.cuts])),
           "chunk": pack_column(joined([grid.chunk for grid in grids])),
           "offset": pack_column(joined([grid.offset for grid in grids]))}
    if ranks.any():
        doc["ranks"] = pack_column(ranks)
    return doc


# -- reading -------------------------------------------------------------------------------------

def parse_grid_columns(doc: Any, keys: list[str], ndim: np.ndarray, dims: np.ndarray, width: np.ndarray,
                       chunk_sizes: np.ndarray, budget: Any) -> GridColumns:
    """The grids of the entries ``keys`` (their shapes: ``ndim`` each, ``dims`` joined; ``width``: their
    element sizes), every check of spec 6.11 done for all of them together on whole columns, the shards
    and pieces taken from ``budget`` before any column they size is read."""
    import numpy as np

    if type(doc) is not dict:
        raise ManifestError("tensor columns: 'grids' must be a map of columns")
    if "counts" in doc or "length" in doc:
        raise ManifestError("tensor columns: 'grids' holds no 'counts' or 'length' (a grid of several pieces a "
                            "cell is a row)")
    ndim = ndim.astype(np.int64)
    dim_start = np.cumsum(ndim) - ndim  # each grid's first dimension among all grids' dimensions
    per_dim = column(doc.get("cells"), "cells", int(ndim.sum()), _WHAT, low=1, high=MAX_SHARDS_PER_TENSOR,
                     table="grid")
    cells = _per_grid_products(per_dim, ndim, dim_start)
    over = np.flatnonzero(cells > MAX_SHARDS_PER_TENSOR)
    if len(over):
        raise ManifestError(f"tensor {keys[over[0]]!r}: shard grid of more than {MAX_SHARDS_PER_TENSOR} cells")
    budget.take(int(cells.sum()), 0)
    cuts_per_dim = per_dim.astype(np.int64) + 1
    first = np.cumsum(cuts_per_dim) - cuts_per_dim  # where each dimension's cuts start
    last = first + cuts_per_dim - 1
    cuts = column(doc.get("cuts"), "cuts", int(cuts_per_dim.sum()), _WHAT, high=_MAX_DIM, table="grid")
    cuts = cuts.astype(np.int64)
    steps = np.diff(cuts)
    within = np.ones(len(steps), dtype=bool)
    within[last[:-1]] = False  # a dimension's last cut to the next one's first
    bad = (cuts[first] != 0) | (cuts[last] != dims.astype(np.int64))
    bad[np.searchsorted(first, np.flatnonzero(within & (steps < 0)), side="right") - 1] = True
    if bad.any():
        dim = int(np.flatnonzero(bad)[0])
        grid = int(np.searchsorted(dim_start, dim, side="right") - 1)
        raise ManifestError(f"tensor {keys[grid]!r}: shard grid cuts[{dim - int(dim_start[grid])}] must run from 0 "
                            f"to the extent {int(dims[dim])} without decreasing")
    ranks = column(doc["ranks"], "ranks", int(cells.sum()), _WHAT, high=MAX_RANK, table="grid") \
        if "ranks" in doc else None
    solid = within & (steps > 0)
    del within
    solid_steps = steps[solid]  # every dimension's non-empty intervals' extents, in order
    del steps
    solid_per_dim = np.add.reduceat(solid, first, dtype=np.int64) if len(first) else np.zeros(0, dtype=np.int64)
    del solid
    pieces = _per_grid_products(solid_per_dim, ndim, dim_start)  # the cells holding elements: a piece each
    total = int(pieces.sum())
    budget.take(0, total)
    chunk = column(doc.get("chunk"), "chunk", total, _WHAT, high=len(chunk_sizes) - 1, table="grid")
    offset = column(doc.get("offset"), "offset", total, _WHAT, high=MAX_CHUNK_BYTES, table="grid")
    piece_end = np.cumsum(pieces)
    length = _piece_lengths(piece_end, pieces, ndim, dim_start, solid_per_dim, solid_steps, width)
    del solid_steps
    past = np.flatnonzero(offset.astype(np.int64) + length > chunk_sizes[chunk]) if total else np.empty(0)
    if len(past):
        row = int(past[0])
        grid = int(np.searchsorted(piece_end, row, side="right"))
        raise ManifestError(f"tensor {keys[grid]!r}: piece [{int(offset[row])}, +{int(length[row])}) runs past "
                            f"chunk {int(chunk[row])} ({int(chunk_sizes[chunk[row]])} bytes)")
    return GridColumns(per_dim, dim_start, ndim, cuts, first, cells, ranks, pieces, chunk, offset, length)


def _per_grid_products(values: np.ndarray, ndim: np.ndarray, dim_start: np.ndarray) -> np.ndarray:
    """The product of each grid's values (one a dimension, none negative; 1 for a grid of none), exact up
    to ``MAX_SHARDS_PER_TENSOR`` and ``MAX_SHARDS_PER_TENSOR + 1`` past it: a sum of logarithms tells which
    products are past it before any is multiplied out (int64 would wrap). One pass over the values,
    whatever the grids' numbers of dimensions."""
    import numpy as np

    products = np.ones(len(ndim), dtype=np.int64)
    has = np.flatnonzero(ndim > 0)
    if not len(has):
        return products
    at = dim_start[has]  # strictly increasing: each grid with dimensions starts its own run of values
    with np.errstate(divide="ignore"):  # log2(0): -inf, the product 0
        logs = np.add.reduceat(np.log2(values.astype(np.float64)), at)
    over = logs > _LOG_LIMIT  # within it, the product is at most the limit: exact in int64
    exact = np.multiply.reduceat(np.where(np.repeat(over, ndim[has]), 1, values).astype(np.int64), at)
    products[has] = np.where(over, MAX_SHARDS_PER_TENSOR + 1, exact)
    return products


#: log2 of the cell limit, and a margin below the next integer's (1e6 + 1: 1.4e-6 above).
_LOG_LIMIT = math.log2(MAX_SHARDS_PER_TENSOR) + 1e-7


def _piece_lengths(piece_end: np.ndarray, pieces: np.ndarray, ndim: np.ndarray, dim_start: np.ndarray,
                   solid_per_dim: np.ndarray, solid_steps: np.ndarray, width: np.ndarray) -> np.ndarray:
    """Each piece's bytes: piece ``i`` of a grid is its ``i``-th cell holding elements in C order, whose
    extent in each dimension is one of that dimension's non-empty intervals (``solid_steps``). A
    dimension of one such interval (its whole extent) gives every cell of its grid the same factor
    (``base``); the others are "cut". A grid cut in one dimension (a data or tensor parallel layout)
    has those intervals' extents as its pieces, gathered for all such grids at once; a grid of many
    pieces, an outer product of its cut dimensions' extents; any other walks its cut dimensions (at
    most 12) piece by piece, some ``_BATCH`` pieces at a time."""
    import numpy as np

    solid_first = np.cumsum(solid_per_dim) - solid_per_dim
    grids = len(ndim)
    cut = np.flatnonzero(solid_per_dim > 1)  # the cut dimensions, by grid then dimension
    cut_count = np.bincount(np.repeat(np.arange(grids), ndim)[cut], minlength=grids)
    cut_end = np.cumsum(cut_count)
    whole = np.where(solid_per_dim == 1, solid_steps[np.minimum(solid_first, max(len(solid_steps) - 1, 0))]
                     if len(solid_steps) else 0, np.where(solid_per_dim == 0, 0, 1))
    base = np.ones(grids, dtype=np.int64)  # a grid with no piece may wrap here: never used
    has = np.flatnonzero(ndim > 0)
    if len(has):
        with np.errstate(over="ignore"):
            base[has] = np.multiply.reduceat(whole.astype(np.int64), dim_start[has])
    base *= width.astype(np.int64)
    piece_start = piece_end - pieces
    length = np.empty(int(piece_end[-1]) if len(piece_end) else 0, dtype=np.int64)
    uncut = np.flatnonzero((cut_count == 0) & (pieces > 0))
    length[piece_start[uncut]] = base[uncut]  # one piece, the whole tensor
    held = pieces > 0  # a grid of no piece (a dimension with no non-empty interval) has no length to make
    once = np.flatnonzero((cut_count == 1) & held)
    if len(once) == grids:  # the usual table: every cut dimension's intervals are its grid's pieces, in order
        length[:] = solid_steps[np.repeat(solid_per_dim > 1, solid_per_dim)] * np.repeat(base, pieces)
    elif len(once):
        dim = cut[cut_end[once] - 1]
        counts = solid_per_dim[dim]  # its pieces
        length[runs(piece_start[once], counts)] = solid_steps[runs(solid_first[dim], counts)] * \
            np.repeat(base[once], counts)
    for g in np.flatnonzero((cut_count > 1) & (pieces >= _OUTER_FROM)).tolist():
        dims = cut[cut_end[g] - cut_count[g]:cut_end[g]]
        extents = [solid_steps[first:first + count] for first, count in zip(solid_first[dims].tolist(),
                                                                            solid_per_dim[dims].tolist())]
        length[piece_start[g]:piece_end[g]] = functools.reduce(np.multiply.outer, extents, base[g:g + 1]).ravel()
    walked = np.flatnonzero((cut_count > 1) & held & (pieces < _OUTER_FROM))
    bounds = np.searchsorted(np.cumsum(pieces[walked]), np.arange(_BATCH, int(pieces[walked].sum()), _BATCH))
    for batch in np.split(walked, bounds + 1) if len(walked) else ():
        if not len(batch):  # two bounds in one grid's pieces
            continue
        at = runs(piece_start[batch], pieces[batch])
        grid = np.repeat(batch, pieces[batch])
        rest = at - piece_start[grid]
        volume = base[grid]
        count_of = cut_count[grid]
        for axis in range(int(count_of.max())):  # from the grid's last cut dimension: it varies fastest
            on = np.flatnonzero(count_of > axis)
            dim = cut[cut_end[grid[on]] - 1 - axis]
            count = solid_per_dim[dim]
            volume[on] *= solid_steps[solid_first[dim] + rest[on] % count]
            rest[on] //= count
        length[at] = volume
    return length


def runs(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``starts[i]``, ``starts[i] + 1``, ... ``counts[i]`` values for each ``i``, one after another."""
    import numpy as np

    before = np.cumsum(counts) - counts
    return np.repeat(starts - before, counts) + np.arange(int(counts.sum()), dtype=np.int64)


#: Pieces of grids cut in several dimensions whose lengths are walked together: a few MiB of index arrays.
_BATCH = 1 << 16
#: A grid cut in several dimensions with at least this many pieces has its lengths made alone, as an
#: outer product: a piece of a smaller one walks at most 12 cut dimensions (a hostile grid cut in 19
#: of 64, walked per piece, took 3 s for 8 million pieces).
_OUTER_FROM = 1 << 12


class GridColumns:
    """The checked ``grids`` columns of a tensor table, from which grid ``j``'s ``ShardGrid`` is made."""

    def __init__(self, per_dim: np.ndarray, dim_start: np.ndarray, ndim: np.ndarray, cuts: np.ndarray,
                 first: np.ndarray, cells: np.ndarray, ranks: np.ndarray | None, pieces: np.ndarray,
                 chunk: np.ndarray, offset: np.ndarray, length: np.ndarray) -> None:
        self._cuts, self._ranks, self._chunk, self._offset, self._length = cuts, ranks, chunk, offset, length
        self._where = (per_dim, dim_start, ndim, first, cells, pieces)

    @functools.cached_property
    def _spans(self) -> tuple[list, list, list, list]:
        """Where each grid's values start and end, as Python ints (made when the first entry is read: a
        table's entries are built a grid at a time; a parse that reads none pays nothing)."""
        import numpy as np

        per_dim, dim_start, ndim, first, cells, pieces = self._where
        return (list(zip((dim_start + ndim).tolist(), dim_start.tolist())),
                list(zip(first.tolist(), (first + per_dim + 1).tolist())),
                list(zip(cells.tolist(), (np.cumsum(cells) - cells).tolist())),
                list(zip(pieces.tolist(), (np.cumsum(pieces) - pieces).tolist())))

    def grid(self, j: int) -> ShardGrid:
        import numpy as np

        dims, cut_spans, cell_spans, piece_spans = self._spans
        end, start = dims[j]
        cuts = [self._cuts[low:high] for low, high in cut_spans[start:end]]
        cells, cell_start = cell_spans[j]
        ranks = self._ranks[cell_start:cell_start + cells] if self._ranks is not None \
            else np.zeros(cells, dtype=np.uint8)
        pieces, at = piece_spans[j]
        starts = None
        if pieces != cells:  # cells without elements: no piece (found from the cuts: no volume multiplied out)
            solid = functools.reduce(np.logical_and.outer, [np.diff(c) > 0 for c in cuts]).ravel()
            starts = np.zeros(cells + 1, dtype=np.int64)
            np.cumsum(solid, out=starts[1:])
        return ShardGrid(cuts, ranks, starts, self._chunk[at:at + pieces], self._offset[at:at + pieces],
                         self._length[at:at + pieces])
