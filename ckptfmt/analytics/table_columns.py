"""What every analytics table builder shares (``tables.py``): the tables' names, the builder protocol,
the list-based builder (rows gathered as Python lists, converted to Arrow a batch at a time, a value
of the wrong type named with its checkpoint and rank), the checks of a manifest's maps and lists, and
strings interned for dictionary-encoded columns.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ckptfmt.errors import ManifestError, quoted
from ckptfmt.format.manifest import Manifest

TABLE_NAMES = ("checkpoints", "saves", "steps", "tensors", "environment", "environments", "system", "tensor_stats",
               "resumes")
#: Wall-clock times: microseconds (a nanosecond timestamp becomes no Python datetime without pandas).
TIME = pa.timestamp("us", tz="UTC")


class TableBuilder(Protocol):
    """What builds one of the tables, a manifest at a time."""

    #: Whether it takes removed checkpoints' history objects too (as both record and manifest).
    reads_history: bool

    def add(self, run: str, record: Any, manifest: Any, where: str) -> None: ...

    def flush(self) -> None: ...

    def table(self) -> pa.Table: ...


class Saved(Protocol):
    """What the history tables read of a save: a commit record, or a removed checkpoint's history object."""

    @property
    def name(self) -> str: ...

    @property
    def step(self) -> int | None: ...

    @property
    def timing(self) -> dict: ...


class RowBuilder:
    """A table built one manifest at a time: its rows are gathered as Python lists, then converted to
    Arrow arrays every ``BATCH_ROWS`` rows (so memory holds Arrow's compact columns, plus a few
    thousand rows' lists, and a conversion's cost is spread over many manifests' rows), where a value
    of the wrong type is named with its checkpoint."""

    #: (column, Arrow type) of the columns, in table order.
    fields: tuple[tuple[str, pa.DataType], ...] = ()
    reads_history = False
    BATCH_ROWS = 2**14

    def __init__(self):
        self.batches: list[dict[str, pa.Array]] = []
        self._start()

    def _start(self) -> None:
        self.columns: dict[str, list] = {name: [] for name, _ in self.fields}
        self.origins: list[tuple[int, str]] = []  # (first row, where) of each manifest's rows in the batch
        self.rows = 0

    def origin(self, where: str) -> None:
        self.origins.append((self.rows, where))

    def flush(self) -> None:
        """Convert the rows gathered to Arrow arrays once they are ``BATCH_ROWS`` or more."""
        if self.rows >= self.BATCH_ROWS:
            self._convert()

    def _convert(self) -> None:
        if self.rows:
            self.batches.append({name: self._array(name, type_, self.columns[name]) for name, type_ in self.fields})
        self._start()

    def table(self) -> pa.Table:
        self._convert()
        columns = []
        for name, type_ in self.fields:
            if type_ == TIME:  # nanoseconds as int64 until now: one conversion for the whole column
                nanoseconds = pa.chunked_array([b[name] for b in self.batches], pa.int64()).combine_chunks()
                columns.append(pc.divide(nanoseconds, 1000).view(TIME))
            else:
                columns.append(pa.chunked_array([b[name] for b in self.batches], type_))
        return pa.Table.from_arrays(columns, names=[name for name, _ in self.fields])

    def _array(self, name: str, type_: pa.DataType, values: list) -> pa.Array:
        type_ = pa.int64() if type_ == TIME else type_
        try:
            return pa.array(values, type=type_)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            row = _first_bad(values, type_)
            index = bisect.bisect_right([start for start, _ in self.origins], row) - 1
            where = self.origins[max(index, 0)][1]
            raise ManifestError(f"{where}: {name} holds {quoted(values[row])}, not a {type_}") from None


def _first_bad(values: list, type_: pa.DataType) -> int:
    for row, value in enumerate(values):
        try:
            pa.array([value], type=type_)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            return row
    return 0


def as_map(value: Any, where: str, what: str) -> dict:
    """A manifest's map (``where``: its checkpoint, ``what``: its field), {} where absent."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ManifestError(f"{where}: {what} is a {type(value).__name__}, not a map")
    return value


def as_list(value: Any, where: str, what: str) -> list:
    """A manifest's array (``where``: its checkpoint, ``what``: its field), [] where absent."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ManifestError(f"{where}: {what} is a {type(value).__name__}, not an array")
    return value


def rank_records(manifest: Manifest | Saved, where: str) -> list[dict]:
    """A save's per-rank timing records (spec 9.4 ``timing.ranks``), each checked to be a map."""
    records = as_list(as_map(manifest.timing, where, "timing").get("ranks"), where, "timing.ranks")
    for index, record in enumerate(records):
        as_map(record, where, f"timing.ranks[{index}]")
    return records


def records_holding(manifest: Manifest | Saved, where: str, field: str,
                    decode: Callable[[Any, str], Any]) -> Iterator[tuple[Any, int, dict]]:
    """(``decode`` of its ``field``, its rank, the record) of each per-rank timing record holding
    ``field``, decoded first, its rank then checked to be an int."""
    for index, record in enumerate(rank_records(manifest, where)):
        if record.get(field) is None:
            continue
        decoded = decode(record[field], f"{where}: timing.ranks[{index}].{field}")
        rank = record.get("rank")
        if type(rank) is not int:
            raise ManifestError(f"{where}: timing.ranks[{index}].rank is not an int")
        yield decoded, rank, record


class Words:
    """Strings interned as int32 ids, for dictionary-encoded columns."""

    def __init__(self, words: Sequence[str] = ()):
        self.ids: dict[str, int] = {word: index for index, word in enumerate(dict.fromkeys(words))}

    def id(self, word: str) -> int:
        return self.ids.setdefault(word, len(self.ids))

    def encode(self, ids: np.ndarray) -> pa.DictionaryArray:
        return pa.DictionaryArray.from_arrays(pa.array(ids, pa.int32()), pa.array(list(self.ids), pa.string()))
