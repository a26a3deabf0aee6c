"""The tensor table in columns (spec 6.12, format 1.12): one packed column per field, not a map per tensor.

A state of 100,000 small tensors cost 214 bytes a tensor beyond its key as
maps (half of them statistics) and a decoded map, shard map and piece list
apiece. In columns a tensor costs its key and a few bytes per field, and a
reader checks every tensor with a few dozen numpy operations. Entries the
columns cannot describe (several shards or pieces, ``same_as``, statistics
that are not exactly binary64) stay maps, in ``rows``, by index.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from itertools import chain, islice, repeat
from typing import TYPE_CHECKING, Any

from ckptfmt.errors import ManifestError
from ckptfmt.format.dtypes import itemsize
from ckptfmt.format.grid_columns import GridColumns, column_grid, grids_to_columns, parse_grid_columns, runs
from ckptfmt.format.limits import MAX_CHUNK_BYTES, MAX_DIMS, MAX_KEY_BYTES, MAX_TENSOR_BYTES, MAX_TENSORS
from ckptfmt.format.shards import MAX_RANK, Piece, ShardEntry, ShardGrid, column, pack_column
from ckptfmt.format.tensor_entry import TENSOR_KINDS, Likeness, TensorEntry, TensorTable, check_table, likeness
from ckptfmt.format.tensor_stats import COUNT_FIELDS, FLOAT_FIELDS, INTEGER_FIELDS, StatsRow, stat_sets
from ckptfmt.kernels.keys import key_scan

if TYPE_CHECKING:
    import numpy as np

#: Statistics sets by their number in the ``set`` column; 0: no statistics (spec 6.12).
STAT_SETS: tuple[tuple[str, ...], ...] = ((), FLOAT_FIELDS, INTEGER_FIELDS, COUNT_FIELDS)
_VALUE_FIELDS = ("min", "max", "mean", "l2", "absmax")
_COUNT_FIELDS = ("nan", "posinf", "neginf", "zeros")
#: Integers binary64 holds exactly: an integer set's extremes beyond them keep their entry a map.
_EXACT = 2**53
_MAX_DIM = 2**63 - 1
_new_tensor = partial(tuple.__new__, TensorEntry)
_new_shard = partial(tuple.__new__, ShardEntry)
_new_piece = partial(tuple.__new__, Piece)


# -- writing -------------------------------------------------------------------------------------

def to_columns(tensors: Sequence[TensorEntry], row_of: Callable[[TensorEntry], dict], *, grids: bool) -> dict:
    """The tensor table ``tensors`` as columns; ``row_of`` writes an entry the columns cannot hold.
    ``grids`` (format 1.14): shard grids of whole-cell pieces go into the ``grids`` columns, their
    entries' items of ``rows`` nil; else they are rows.

    Each entry's layout is checked on its own; its statistics a set at a time, in groups (the rows of
    one ``StatsRow`` columns, or the other maps), a column per field: what binary64 holds exactly is
    checked on a group's whole column, entry by entry only if that fails.
    """
    places = [_one_piece(tensor) for tensor in tensors]
    gridded = {index: grid for index, (tensor, place) in enumerate(zip(tensors, places))
               if grids and place is None and (grid := column_grid(tensor)) is not None}
    sets = [_stat_set(tensor.stats, tensor.numel) if place or index in gridded else None
            for index, (tensor, place) in enumerate(zip(tensors, places))]
    values, counts = _stat_cells(tensors, sets)  # an entry whose statistics the cells cannot hold: a row
    in_grids = [index for index in gridded if sets[index] is not None]
    row_at = sorted([index for index, stat_set in enumerate(sets) if stat_set is None] + in_grids)
    entries = [tensor if stat_set is not None else _PLACEHOLDER for tensor, stat_set in zip(tensors, sets)]
    dtypes: dict[str, int] = {}
    dtype_ids = [dtypes.setdefault(entry.dtype, len(dtypes)) if entry.dtype else 0 for entry in entries]
    shapes = [entry.shape for entry in entries]
    doc: dict[str, Any] = {
        "key": [entry.key for entry in entries], "dtypes": list(dtypes), "dtype": _pack(dtype_ids),
        "ndim": _pack(list(map(len, shapes))), "dims": _pack(list(chain.from_iterable(shapes))),
    }
    held = [place if place and stat_set is not None else _NO_PLACE for place, stat_set in zip(places, sets)]
    optional = {"kind": [_KIND_NUMBERS[entry.kind] for entry in entries],
                "requires_grad": [entry.requires_grad for entry in entries], "rank": [p[0] for p in held]}
    doc.update((name, _pack(cells)) for name, cells in optional.items() if any(cells))
    doc.update(chunk=_pack([p[1] for p in held]), offset=_pack([p[2] for p in held]))
    if any(sets):
        doc["stats"] = {"set": _pack([stat_set or 0 for stat_set in sets]),
                        **{name: values[:, i].tobytes() for i, name in enumerate(_VALUE_FIELDS)},
                        **{name: pack_column(counts[:, i]) for i, name in enumerate(_COUNT_FIELDS)}}
    if row_at:
        doc.update(rows=[None if sets[index] is not None else row_of(tensors[index]) for index in row_at],
                   row_at=_pack(row_at))
    if in_grids:
        doc["grids"] = grids_to_columns([gridded[index] for index in in_grids])
    return doc


class _Placeholder:
    """What a ``rows`` entry leaves in the columns: zeros, an empty key."""

    key, dtype, shape, kind, requires_grad, stats = "", "", (), "tensor", False, None


_PLACEHOLDER: Any = _Placeholder()
_NO_PLACE = (0, 0, 0)
_KIND_NUMBERS = {kind: number for number, kind in enumerate(TENSOR_KINDS)}


def _pack(values: list) -> bytes:
    import numpy as np

    return pack_column(np.array(values, dtype=np.uint64))


def _one_piece(tensor: TensorEntry) -> tuple[int, int, int] | None:
    """(rank, chunk, offset) of a tensor held as one shard covering it in one piece (no piece when it
    has no bytes), without ``same_as``; None for any other entry."""
    shards = tensor.shards
    if type(shards) is not tuple or len(shards) != 1 or tensor.same_as is not None:
        return None
    offsets, shape, rank, pieces = shards[0]
    if shape != tensor.shape or any(offsets) or max(shape, default=0) > _MAX_DIM:
        return None
    nbytes = tensor.nbytes
    if not pieces:
        return (rank, 0, 0) if nbytes == 0 else None
    if len(pieces) != 1 or pieces[0].length != nbytes:
        return None
    return rank, pieces[0].chunk, pieces[0].offset


_SET_OF_SIZE = {len(FLOAT_FIELDS): (1, frozenset(FLOAT_FIELDS)), len(INTEGER_FIELDS): (2, frozenset(INTEGER_FIELDS)),
                len(COUNT_FIELDS): (3, frozenset(COUNT_FIELDS))}


def _stat_set(stats: Mapping[str, Any] | None, numel: int) -> int | None:
    """The number of the set ``stats`` holds (0: none), or None for fields of no one set, or a count that
    is not the tensor's (the row form keeps those as they are)."""
    if stats is None:
        return 0
    number, fields = _SET_OF_SIZE.get(len(stats), (None, None))
    return number if fields is not None and stats.keys() == fields and stats["count"] == numel else None


def _stat_cells(tensors: Sequence[TensorEntry], sets: list[int | None]) -> tuple[np.ndarray, np.ndarray]:
    """The statistics' binary64 and count cells, a set at a time; an entry whose values the cells do not
    hold exactly (an int in the float set, a NaN, an integer extreme over 2^53, a count not an int) has
    its set made None in ``sets``: it is written as a map."""
    import numpy as np

    values, counts = np.zeros((len(tensors), 5), dtype="<f8"), np.zeros((len(tensors), 4), dtype=np.int64)
    for number, value_names, count_names in ((1, _VALUE_FIELDS, _COUNT_FIELDS), (2, ("min", "max"), ("zeros",))):
        at = [index for index, stat_set in enumerate(sets) if stat_set == number]
        names = (*value_names, *count_names)
        for indexes, cells in _cell_groups(tensors, at, names):
            if not all(_exact(number, name, column) for name, column in cells.items()):
                indexes, cells = _exact_entries(number, indexes, cells, sets)
            for name in value_names:
                values[indexes, _VALUE_FIELDS.index(name)] = np.array(cells[name], dtype=np.float64)  # None: NaN
            for name in count_names:
                counts[indexes, _COUNT_FIELDS.index(name)] = cells[name]
    return values, counts


def _exact_entries(number: int, indexes: list[int], cells: dict[str, Any],
                   sets: list[int | None]) -> tuple[list[int], dict[str, Any]]:
    """The entries of a group that failed ``_exact`` whose own cells pass it, and their cells; the others
    have their set made None (written as maps). Each group settles alone: recomputing every group
    after each failing one was quadratic in the groups (a save of 1,000 packs, each with an int64
    extreme, ran out of recursion)."""
    import numpy as np

    def cell(column: Any, at: int) -> Any:
        return column[at].item() if isinstance(column, np.ndarray) else column[at]
    keep = []
    for at, index in enumerate(indexes):
        if all(_exact(number, name, [cell(column, at)]) for name, column in cells.items()):
            keep.append(at)
        else:
            sets[index] = None
    return [indexes[at] for at in keep], {name: column[keep] if isinstance(column, np.ndarray)
                                          else [column[at] for at in keep] for name, column in cells.items()}


def _cell_groups(tensors: Sequence[TensorEntry], at: list[int],
                 names: tuple[str, ...]) -> list[tuple[list[int], dict[str, Any]]]:
    """The statistics cells of the entries ``at``, by field, in groups: the rows of each ``StatsRow``
    columns as arrays taken from them at once (a Python number made per cell was most of writing the
    statistics of 100,000 small tensors), the other maps' cells as lists."""
    tables: dict[int, tuple[dict, list[int], list[int]]] = {}  # columns' id -> them, entries, their rows
    others = []
    for index in at:
        stats = tensors[index].stats
        if type(stats) is StatsRow:
            table = tables.get(id(stats.columns))
            if table is None:
                table = tables[id(stats.columns)] = (stats.columns, [], [])
            table[1].append(index)
            table[2].append(stats.at)
        else:
            others.append(index)
    groups = [(indexes, {name: columns[name][rows] for name in names}) for columns, indexes, rows in tables.values()]
    if others:
        maps = [tensors[index].stats or {} for index in others]
        groups.append((others, {name: [stats[name] for stats in maps] for name in names}))
    return groups


def _exact(stat_set: int, name: str, column: list | np.ndarray) -> bool:
    """Whether binary64 (or, for counts, an unsigned column) holds every value of ``column`` exactly."""
    import numpy as np

    if isinstance(column, np.ndarray):  # a ``StatsRow`` column's cells: numbers of its dtype, no nil
        if name in _COUNT_FIELDS:
            return column.dtype.kind in "iu" and bool((column >= 0).all())
        if stat_set == 1:
            return column.dtype == np.float64 and not np.isnan(column).any()
        return column.dtype.kind in "iu" and bool(((-_EXACT <= column) & (column <= _EXACT)).all())
    types = set(map(type, column))
    if name in _COUNT_FIELDS:
        return types <= _INT and min(column, default=0) >= 0
    if stat_set == 1:  # floats, none of them NaN: NaN stands for nil (None, which numpy makes NaN)
        return types <= _FLOAT_OR_NIL and int(np.isnan(np.array(column, dtype=np.float64)).sum()) == column.count(None)
    present = [value for value in column if value is not None]
    return types <= _INT_OR_NIL and all(-_EXACT <= value <= _EXACT for value in present)


_INT, _FLOAT_OR_NIL, _INT_OR_NIL = {int}, {float, type(None)}, {int, type(None)}


# -- reading -------------------------------------------------------------------------------------

def parse_columns(doc: dict, chunk_sizes: np.ndarray, budget: Any,
                  parse_rows: Callable[[list[tuple[int, Any]]], list[TensorEntry]]) -> TensorTable:
    """The entries of a tensor table in columns, every check of spec 6.12 done on whole columns, keys
    and ``same_as`` included; ``parse_rows([(index, map), ...])`` parses the entries of ``rows`` as the
    row form's are. The entries are built from the checked columns when read (``TensorTable``)."""
    import numpy as np

    keys, empty, over = _keys(doc.get("key"))
    count = len(keys)
    if count > MAX_TENSORS:
        raise ManifestError("too many chunks or tensors")
    names = doc.get("dtypes")
    if type(names) is not list or not all(type(name) is str for name in names) or len(set(names)) != len(names):
        raise ManifestError("tensor columns: 'dtypes' must be an array of distinct strings")
    widths = np.array([itemsize(name) for name in names] or [0], dtype=np.int64)
    col = partial(_column, doc, count)
    dtype = col("dtype", high=max(len(names) - 1, 0))
    ndim = col("ndim", high=MAX_DIMS)
    dims = column(doc.get("dims"), "dims", int(ndim.sum()), "tensor columns", high=_MAX_DIM, table="tensor")
    kind = col("kind", high=len(TENSOR_KINDS) - 1, optional=True)
    grad = col("requires_grad", high=1, optional=True)
    rank = col("rank", high=MAX_RANK, optional=True)
    chunk = col("chunk", high=max(len(chunk_sizes) - 1, 0))
    offset = col("offset", high=MAX_CHUNK_BYTES)
    every_row_at, rows = _rows(doc, count)
    gridded = np.array([row is None for row in rows], dtype=bool)  # 1.14: the entry's shards are in 'grids'
    row_at, grid_at = every_row_at[~gridded], every_row_at[gridded]
    in_rows, in_grids = np.zeros(count, dtype=bool), np.zeros(count, dtype=bool)
    in_rows[row_at] = True
    in_grids[grid_at] = True
    fields = [dtype, ndim, kind, grad, rank, chunk, offset]
    if any(column_values[row_at].any() for column_values in fields) or any(keys[i] for i in row_at.tolist()):
        raise ManifestError("tensor columns: an entry of 'rows' must be zero in every column, its key empty")
    if any(column_values[grid_at].any() for column_values in (rank, chunk, offset)):
        raise ManifestError("tensor columns: an entry of 'grids' must be zero in 'rank', 'chunk' and 'offset'")
    if ("grids" in doc) != bool(len(grid_at)):
        raise ManifestError("tensor columns: 'grids' must be present exactly when an item of 'rows' is nil")
    if not names and len(row_at) < count:
        raise ManifestError("tensor columns: 'dtypes' is empty")
    numel = _numel(ndim, dims, keys)
    nbytes = numel * widths[dtype]
    too_big = np.flatnonzero(nbytes > MAX_TENSOR_BYTES)
    if len(too_big):
        raise ManifestError(f"{_what(keys, too_big[0])}: its shape is over the size limit")
    if empty != len(row_at) or over >= 0:
        _name_bad_key(keys, in_rows)
    held = ~in_rows & ~in_grids & (nbytes > 0)
    budget.take(count - len(every_row_at), int(held.sum()))
    _check_pieces(chunk, offset, nbytes, held, in_rows | in_grids, chunk_sizes, keys)
    stats = _parse_stats(doc.get("stats"), count, dtype, names, numel, in_rows, keys) if "stats" in doc else None
    grids = _parse_grids(doc.get("grids"), grid_at, keys, ndim, dims, widths[dtype], chunk_sizes, budget) \
        if len(grid_at) else None
    at = row_at.tolist()
    parsed = dict(zip(at, parse_rows(list(zip(at, [row for row in rows if row is not None])))))
    columns = _Columns(keys, names, dtype, ndim, dims, kind, grad, rank, chunk, offset, numel, nbytes, stats, parsed,
                       grids)
    check_table(columns.keys(), parsed.values(), columns.likeness)
    return TensorTable(lazy=columns, count=count)


def _parse_grids(doc: Any, grid_at: np.ndarray, keys: list[str], ndim: np.ndarray, dims: np.ndarray,
                 widths: np.ndarray, chunk_sizes: np.ndarray, budget: Any) -> tuple[list[int], GridColumns]:
    """The entries ``grid_at``'s shard grids (``grid_columns``), their shapes gathered from ``dims``."""
    import numpy as np

    grid_ndim = ndim[grid_at].astype(np.int64)
    grid_dims = dims[runs((np.cumsum(ndim, dtype=np.int64) - ndim)[grid_at], grid_ndim)]
    at = grid_at.tolist()
    return at, parse_grid_columns(doc, [keys[i] for i in at], grid_ndim, grid_dims, widths[grid_at], chunk_sizes,
                                  budget)


class _Columns:
    """A checked tensor table's columns, from which its entries are built when read (``TensorTable``)."""

    def __init__(self, keys: list[str], names: list[str], dtype: np.ndarray, ndim: np.ndarray, dims: np.ndarray,
                 kind: np.ndarray, grad: np.ndarray, rank: np.ndarray, chunk: np.ndarray, offset: np.ndarray,
                 numel: np.ndarray, nbytes: np.ndarray, stats: tuple | None, rows: dict[int, TensorEntry],
                 grids: tuple[list[int], GridColumns] | None) -> None:
        import numpy as np

        every = list(keys)
        for index, entry in rows.items():
            every[index] = entry.key
        self._keys, self._names, self._rows = every, names, rows
        self._dtype, self._ndim, self._dims, self._kind, self._grad = dtype, ndim, dims, kind, grad
        self._rank, self._chunk, self._offset, self._numel, self._nbytes = rank, chunk, offset, numel, nbytes
        self._stats = stats
        self._starts = np.cumsum(ndim, dtype=np.int64) - ndim
        self._row_at = sorted(rows)
        self._grid_at: list[int] = grids[0] if grids is not None else []
        self._grids: GridColumns | None = grids[1] if grids is not None else None

    def keys(self) -> list[str]:
        """Every entry's key, those of ``rows`` included."""
        return self._keys

    def likeness(self, at: int) -> Likeness:
        """An entry's likeness (``check_table``) from its cells; only rows have a ``same_as``."""
        if at in self._rows:
            return likeness(self._rows[at])
        start = int(self._starts[at])
        return (self._names[self._dtype[at]] if self._names else "",
                tuple(self._dims[start:start + int(self._ndim[at])].tolist()),
                TENSOR_KINDS[self._kind[at]], bool(self._grad[at]), None)

    def entries(self, start: int = 0, stop: int | None = None) -> list[TensorEntry]:
        """The entries numbered ``start`` to ``stop`` (the end by default), built by maps over the columns."""
        stop = len(self._keys) if stop is None else min(stop, len(self._keys))
        if stop <= start:
            return []
        at = slice(start, stop)
        dims = self._dims[int(self._starts[start]):int(self._starts[stop - 1] + self._ndim[stop - 1])]
        stats = None if self._stats is None else tuple(column[at] for column in self._stats)
        grid_at, grids = self._grid_at, self._grids
        gridded = {grid_at[j] - start: grids.grid(j) for j in range(bisect_left(grid_at, start),
                                                                     bisect_left(grid_at, stop))} \
            if grids is not None else {}
        entries = _entries(self._keys[at], self._names, self._dtype[at], self._ndim[at], dims, self._kind[at],
                           self._grad[at], self._rank[at], self._chunk[at], self._offset[at], self._numel[at],
                           self._nbytes[at], stats, gridded)
        for index in self._row_at[bisect_left(self._row_at, start):bisect_left(self._row_at, stop)]:
            entries[index - start] = self._rows[index]
        return entries


def _column(doc: dict, count: int, name: str, *, high: int, optional: bool = False) -> np.ndarray:
    import numpy as np

    if optional and name not in doc:
        return np.zeros(count, dtype=np.uint8)
    return column(doc.get(name), name, count, "tensor columns", high=high, table="tensor")


def _rows(doc: dict, count: int) -> tuple[np.ndarray, list]:
    """The indexes and maps of the entries held as maps, indexes strictly increasing."""
    import numpy as np

    if ("rows" in doc) != ("row_at" in doc):
        raise ManifestError("tensor columns: 'rows' and 'row_at' must be present together")
    rows = doc.get("rows", [])
    if type(rows) is not list:
        raise ManifestError("tensor columns: 'rows' must be an array of tensor entries")
    at = column(doc["row_at"], "row_at", len(rows), "tensor columns", high=max(count - 1, 0), table="tensor") \
        if rows or "row_at" in doc else np.empty(0, dtype=np.int64)
    if len(at) and (count == 0 or (len(at) > 1 and not (np.diff(at.astype(np.int64)) > 0).all())):
        raise ManifestError("tensor columns: 'row_at' must name entries in increasing order, each once")
    return at.astype(np.int64), rows


def _numel(ndim: np.ndarray, dims: np.ndarray, keys: list) -> np.ndarray:
    """Each entry's element count, exactly, refusing a count over the byte limit before it can overflow."""
    import numpy as np

    count = len(ndim)
    starts = np.cumsum(ndim, dtype=np.int64) - ndim
    numel = np.ones(count, dtype=np.int64)
    approx = np.ones(count, dtype=np.float64)
    empty = np.zeros(count, dtype=bool)
    for axis in range(int(ndim.max()) if count else 0):
        has = ndim > axis
        extent = np.ones(count, dtype=np.int64)
        extent[has] = dims[starts[has] + axis]
        empty |= extent == 0
        approx *= extent
        numel *= np.where(approx > MAX_TENSOR_BYTES, 1, extent)  # stays exact; the entry is refused below
    over = np.flatnonzero(~empty & (approx > MAX_TENSOR_BYTES))
    if len(over):
        raise ManifestError(f"{_what(keys, over[0])}: its shape is over the size limit")
    numel[empty] = 0
    return numel


def _what(keys: list[str], index: Any) -> str:
    """An entry, for an error: by its key, or by its number where the key is empty (an entry of rows)."""
    index = int(index)
    return f"tensor {keys[index]!r}" if keys[index] else f"tensor {index}"


def _keys(keys: Any) -> tuple[list[str], int, int]:
    """The 'key' column, an array of strings, with ``key_scan``'s count of empty keys and its first
    over-long one (-1: none)."""
    stray, empty, over = key_scan(keys, MAX_KEY_BYTES) if type(keys) is list else (0, 0, -1)
    if type(keys) is not list or stray >= 0:
        raise ManifestError("tensor columns: 'key' must be an array of strings")
    return keys, empty, over


def _name_bad_key(keys: list[str], in_rows: np.ndarray) -> None:
    """Refuse the first column entry whose key is empty or over MAX_KEY_BYTES bytes of UTF-8, found
    entry by entry once ``key_scan`` has counted one (the entries of ``rows`` have empty keys, checked
    before)."""
    for index, length in enumerate(map(len, keys)):
        if (length == 0 or length > MAX_KEY_BYTES // 4) and not in_rows[index] and (
                not length or len(keys[index].encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES):
            raise ManifestError(f"tensor {index} has an invalid key")


def _check_pieces(chunk: np.ndarray, offset: np.ndarray, nbytes: np.ndarray, held: np.ndarray,
                  in_rows: np.ndarray, sizes: np.ndarray, keys: list) -> None:
    """A held entry's piece lies in its chunk; an entry of no bytes names none (chunk and offset 0)."""
    import numpy as np

    if held.any():
        if not len(sizes):
            raise ManifestError(f"{_what(keys, np.flatnonzero(held)[0])}: its piece names a chunk outside "
                                "the chunk table of 0 rows")
        rows = chunk.astype(np.int64)
        outside = np.flatnonzero(held & (offset.astype(np.int64) + nbytes > sizes[rows]))
        if len(outside):
            index = int(outside[0])
            raise ManifestError(f"{_what(keys, index)}: piece [{offset[index]}, +{nbytes[index]}) runs past "
                                f"chunk {rows[index]} ({sizes[rows[index]]} bytes)")
    stray = np.flatnonzero(~held & ~in_rows & ((chunk != 0) | (offset != 0)))
    if len(stray):
        raise ManifestError(f"{_what(keys, stray[0])}: an entry of no bytes must have chunk and offset 0")


def _parse_stats(doc: Any, count: int, dtype: np.ndarray, names: list[str], numel: np.ndarray,
                 in_rows: np.ndarray, keys: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The statistics columns, checked: (set, values count x 5 binary64, counts count x 4). Each check
    runs on the column of one field, and on the entries of a set only where that set is present."""
    import numpy as np

    if type(doc) is not dict:
        raise ManifestError("tensor columns: 'stats' must be a map of columns")
    sets = column(doc.get("set"), "set", count, "tensor statistics", high=len(STAT_SETS) - 1, table="tensor")
    for name in _VALUE_FIELDS:
        raw = doc.get(name)
        if type(raw) is not bytes or len(raw) != 8 * count:
            raise ManifestError(f"tensor statistics: {name!r} must be a bin of {count} binary64 values")
    values = np.stack([np.frombuffer(doc[name], dtype="<f8") for name in _VALUE_FIELDS]) if count \
        else np.zeros((5, 0), np.float64)
    counts = np.stack([column(doc.get(name), name, count, "tensor statistics", table="tensor").astype(np.int64)
                       for name in _COUNT_FIELDS]) if count else np.zeros((4, 0), np.int64)
    allowed = np.array([[True] + [frozenset(STAT_SETS[s]) in stat_sets(name) for s in (1, 2, 3)] for name in names]
                       or [[True, False, False, False]])
    bad = np.flatnonzero(~allowed[dtype, sets] | (in_rows & (sets != 0)))
    if len(bad):
        index = int(bad[0])
        raise ManifestError(f"{_what(keys, index)}: statistics set {int(sets[index])} is not one spec 6.10 "
                            f"allows for {names[dtype[index]] if names else 'it'}")
    present = np.flatnonzero(np.bincount(sets, minlength=len(STAT_SETS))).tolist()
    stray = [_first_stray(values.view(np.uint64), counts, np.flatnonzero(sets == number), number)
             for number in present if number != 1]
    if any(index is not None for index in stray):
        raise ManifestError(f"{_what(keys, min(i for i in stray if i is not None))}: a statistics column holds "
                            "a value its set does not have (it must be 0)")
    over = np.flatnonzero((counts > numel).any(axis=0))
    if len(over):
        raise ManifestError(f"{_what(keys, over[0])}: a statistics count is over its elements")
    if 2 in present:
        at = np.flatnonzero(sets == 2)
        extremes = values[:2, at]
        inexact = (~np.isnan(extremes) & ((extremes != np.trunc(extremes)) | (np.abs(extremes) > _EXACT))).any(axis=0)
        if inexact.any():
            raise ManifestError(f"{_what(keys, at[np.flatnonzero(inexact)[0]])}: an integer set's min or max is "
                                "not an integer of at most 2^53")
    return sets, values.T, counts.T


#: The value and count fields each statistics set leaves out: zero in its columns (spec 6.12).
_ABSENT = [(tuple(range(5)), tuple(range(4))), ((), ()), ((2, 3, 4), (0, 1, 2)), (tuple(range(5)), tuple(range(4)))]


def _first_stray(values: np.ndarray, counts: np.ndarray, at: np.ndarray, number: int) -> int | None:
    """The first of the entries ``at`` (of set ``number``) with a value or count its set leaves out."""
    import numpy as np

    value_fields, count_fields = _ABSENT[number]
    held = np.concatenate([values[list(value_fields)][:, at].astype(bool), counts[list(count_fields)][:, at] != 0])
    stray = np.flatnonzero(held.any(axis=0))
    return int(at[stray[0]]) if len(stray) else None


def _entries(keys, names, dtype, ndim, dims, kind, grad, rank, chunk, offset, numel, nbytes, stats,
             grids: dict[int, ShardGrid]) -> list:
    """The ``TensorEntry`` of every entry (those of ``rows`` are replaced by the caller; ``grids``: the
    shards of those whose are a grid, by position), built by maps over the columns: a Python loop per
    entry costs more than the rest of the parse."""
    import numpy as np

    ndims = ndim.tolist()
    flat = iter(dims.tolist())
    shapes = list(map(tuple, map(islice, repeat(flat), ndims)))
    lengths = nbytes.tolist()
    pieces: list[tuple] = list(zip(map(_new_piece, zip(chunk.tolist(), offset.tolist(), lengths))))
    for index in np.flatnonzero(nbytes == 0).tolist():
        pieces[index] = ()
    origins = [(0,) * length for length in range(MAX_DIMS + 1)]
    shards: list = list(zip(map(_new_shard, zip(map(origins.__getitem__, ndims), shapes, rank.tolist(), pieces))))
    for index, grid in grids.items():
        shards[index] = grid
    dtypes = list(map(names.__getitem__, dtype.tolist())) if names else [""] * len(keys)
    kinds = map(TENSOR_KINDS.__getitem__, kind.tolist())
    per_stats = _stats_dicts(stats, numel) if stats is not None else repeat(None)
    return list(map(_new_tensor, zip(keys, dtypes, shapes, shards, kinds, map(bool, grad.tolist()), repeat(None),
                                     per_stats)))


def _stats_dicts(stats: tuple, numel: np.ndarray) -> list[dict | None]:
    """Each entry's statistics as the map its row would hold (nil for NaN; an integer set's ints), a set
    at a time: ``dict(zip(fields, cells))`` over columns of Python values."""
    import numpy as np

    sets, values, counts = stats
    out: list[dict | None] = [None] * len(sets)
    for number, fields in enumerate(STAT_SETS):
        at = np.flatnonzero(sets == number)
        if number == 0 or not len(at):
            continue
        cells = {"count": numel[at].tolist()}
        for i, name in enumerate(_VALUE_FIELDS):
            if name in fields:
                column = values[at, i]
                nan = np.isnan(column)
                cells[name] = _nil_for_nan(np.where(nan, 0, column).astype(np.int64) if number == 2 else column, nan)
        for i, name in enumerate(_COUNT_FIELDS):
            if name in fields:
                cells[name] = counts[at, i].tolist()
        made = map(dict, map(zip, repeat(fields), zip(*(cells[name] for name in fields))))
        for index, entry_stats in zip(at.tolist(), made):
            out[index] = entry_stats
    return out


def _nil_for_nan(column: np.ndarray, nan: np.ndarray) -> list:
    """The column's values as Python numbers, None where ``nan``."""
    if not nan.any():
        return column.tolist()
    boxed = column.astype(object)
    boxed[nan] = None
    return boxed.tolist()
