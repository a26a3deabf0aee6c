"""A tensor table entry (spec 6.4): what a reader knows of one tensor of the state, whichever form
(rows of maps, or columns, spec 6.12) the manifest holds it in."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, overload

from ckptfmt._collector import collector_paused
from ckptfmt.errors import ManifestError, quoted
from ckptfmt.format.dtypes import itemsize
from ckptfmt.format.shards import ShardEntry, ShardGrid
from ckptfmt.kernels.keys import first_repeat

#: What a loader rebuilds (spec 6.8), in the order the tensor columns number them (spec 6.12).
TENSOR_KINDS = ("tensor", "parameter", "numpy")


class TensorEntry(NamedTuple):
    """A tensor of the state: key, dtype, global shape, and the shards that tile it."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    #: One ``ShardEntry`` per box, or (format 1.6, many shards) a ``ShardGrid`` of packed columns.
    shards: tuple[ShardEntry, ...] | ShardGrid
    kind: str = "tensor"
    requires_grad: bool = False
    same_as: int | None = None
    #: The statistics of its elements (spec 6.10, format 1.4), or None where not recorded: a dict when
    #: read; a save's own may be a read-only row of its pack's columns (format/tensor_stats.py ``StatsRow``).
    stats: Mapping[str, Any] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


#: What a ``same_as`` entry must share with the entry it names: dtype, shape, kind, requires_grad, and no
#: ``same_as`` of its own (spec 6.9).
Likeness = tuple[str, tuple[int, ...], str, bool, int | None]


def likeness(entry: TensorEntry) -> Likeness:
    return entry.dtype, entry.shape, entry.kind, entry.requires_grad, entry.same_as


def check_table(keys: list[str], entries: Iterable[TensorEntry], likeness_of: Callable[[int], Likeness]) -> None:
    """What a reader checks of a whole tensor table: no two ``keys`` alike, and each of ``entries`` with
    a ``same_as`` names an entry (``likeness_of(index)``) of the same dtype, shape, kind and
    requires_grad that has none."""
    repeat = first_repeat(keys)
    if repeat is not None:
        raise ManifestError(f"two tensors share one key: {quoted(keys[repeat])}")
    for entry in entries:
        if entry.same_as is not None and likeness_of(entry.same_as) != (*likeness(entry)[:4], None):
            raise ManifestError(f"tensor {entry.key!r}: same_as names a different tensor")


class LazyEntries(Protocol):
    """Where a ``TensorTable`` read in columns builds its entries from: checked columns."""

    def keys(self) -> list[str]: ...

    def entries(self, start: int = 0, stop: int | None = None) -> list[TensorEntry]: ...


class TensorTable(Sequence[TensorEntry]):
    """A manifest's tensor table: a sequence of ``TensorEntry``, indexed as the manifest numbers them.

    A table read in columns (spec 6.12) is checked whole when the manifest is parsed, but its entries
    are built only when read, by maps over the columns: a block of ``BLOCK`` entries around each index
    asked for (opening a checkpoint of 100,000 tensors to read one), the whole table when it is
    iterated, sliced, or read by index in more than ``BLOCKS`` blocks (a reader walking it by index pays
    the whole build once). Building 100,000 entries and their statistics maps was most of a manifest's
    parse, for callers (listing, verifying, analytics) that never read them.
    """

    __slots__ = ("_blocks", "_built", "_count", "_lazy")

    #: Entries built together when one is read by index (a table of no more is built whole at once).
    BLOCK = 256
    #: Blocks built one at a time before the whole table is.
    BLOCKS = 8

    def __init__(self, entries: Iterable[TensorEntry] = (), *, lazy: LazyEntries | None = None,
                 count: int = 0) -> None:
        self._built: list[TensorEntry] | None = None if lazy is not None else list(entries)
        self._lazy = lazy
        self._blocks: dict[int, list[TensorEntry]] = {}
        self._count = count if self._built is None else len(self._built)

    def keys(self) -> list[str]:
        """Every entry's key, in order, without building the entries."""
        lazy = self._lazy
        return list(lazy.keys()) if lazy is not None else [entry.key for entry in self._entries()]

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> TensorEntry: ...

    @overload
    def __getitem__(self, index: slice) -> list[TensorEntry]: ...

    def __getitem__(self, index: int | slice) -> TensorEntry | list[TensorEntry]:
        lazy, block_size = self._lazy, self.BLOCK
        if lazy is None or isinstance(index, slice) or self._count <= block_size:
            return self._entries()[index]
        at = operator.index(index)
        at = at + self._count if at < 0 else at
        if not 0 <= at < self._count:
            raise IndexError("tensor table index out of range")
        number = at // block_size
        block = self._blocks.get(number)
        if block is None:
            if len(self._blocks) >= self.BLOCKS:
                return self._entries()[at]
            with collector_paused():
                block = lazy.entries(number * block_size, (number + 1) * block_size)
            if self._lazy is lazy:  # else another thread built the whole table meanwhile
                self._blocks[number] = block
        return block[at - number * block_size]

    def __iter__(self) -> Iterator[TensorEntry]:
        return iter(self._entries())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (TensorTable, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compared by its entries, like the list it stands for

    def __repr__(self) -> str:
        return f"TensorTable({self._count} entries)"

    def _entries(self) -> list[TensorEntry]:
        """Every entry, built now if they are not yet. Threads may read one table: the entries are set
        before the columns are let go, so a thread that finds no columns finds the entries."""
        lazy = self._lazy
        if lazy is None:
            built = self._built
            assert built is not None
            return built
        with collector_paused():  # a named tuple, shard, piece and statistics map per entry: no cycles
            built = self._built = lazy.entries()
        self._lazy, self._blocks = None, {}
        return built


def as_table(tensors: Any) -> TensorTable:
    """``tensors`` (a ``TensorTable``, or entries in any iterable) as a ``TensorTable``."""
    return tensors if isinstance(tensors, TensorTable) else TensorTable(tensors)
