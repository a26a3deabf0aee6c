"""The analytics tables built from the step and system sample records of a save's timing (spec 9.4),
as whole numpy arrays rather than rows: steps (millions of rows in a long run) and system.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from ckptfmt.analytics.table_columns import TIME, Saved, Words, records_holding
from ckptfmt.metadata.rng_digests import RNG_DIGEST_BYTES
from ckptfmt.metadata.step_timer import BATCH_DIGEST_BYTES, decode_steps
from ckptfmt.metadata.system import decode_samples


class Steps:
    """One row per training step of a rank (spec 9.4), with a column per phase (``phase_<name>``) and per
    metric (``metric_<name>``) met anywhere in the run.

    Step records are bins of little-endian numbers: each is decoded as numpy
    views and copied at once into the window's growing columns (``Growing``),
    so a manifest is let go as soon as it is added (views kept for a window held
    some 40 manifests' step bytes, and left the heap fragmented around them when
    they went). Every ``WINDOW_ROWS`` rows or so the window's columns become
    Arrow arrays without a copy (a chunk of each column); strings are
    dictionary-encoded (a run's millions of steps share a few names and hosts).
    """

    WINDOW_ROWS = 2**18
    reads_history = True

    def __init__(self, words: Sequence[str] = ()):
        self.words = Words(words)
        self.chunks: list[tuple[int, dict[str, pa.Array]]] = []  # (rows, arrays)
        self.capacity = 1024  # rows a window's columns start with: the last window's, once there is one
        self._start_window()

    def _start_window(self) -> None:
        self.fixed = {name: Growing(dtype, self.capacity, width) for name, dtype, width in _STEP_COLUMNS}
        #: phase_<name> (NaN where the step had none: null in the table), metric_<name> (NaN, with
        #: ``missing``) and rng_<generator> (zeros where unread: null), in the order met.
        self.named: dict[str, Growing] = {}
        self.missing: dict[str, Growing] = {}  # metric_<name>: True where the step recorded none
        self.rows = 0
        self.added = 0  # the rows of the last manifest added

    def _named(self, name: str, dtype: Any, fill: Any, width: int = 1) -> Growing:
        column = self.named.get(name)
        if column is None:
            column = self.named[name] = Growing(dtype, self.capacity, width, fill)
        return column

    def add(self, run: str, record: Saved, manifest: Saved, where: str) -> None:
        """A manifest's step records, decoded as views and copied into the window's columns a column at a
        time (a call per column and manifest, not per rank record: 64 ranks' records cost 64 times the
        calls), the views let go when it returns."""
        decoded: list[tuple[Any, int, int]] = []  # (columns, rank, host id) per record with steps
        for columns, rank, rank_record in records_holding(manifest, where, "steps", decode_steps):
            decoded.append((columns, rank, self.words.id(str(rank_record.get("host")))))
        counts = np.array([columns.count for columns, _, _ in decoded], dtype=np.int64)
        fixed, first, total = self.fixed, self.rows, int(counts.sum())
        fixed["run"].fill(self.words.id(run), total)
        fixed["checkpoint"].fill(self.words.id(record.name), total)
        fixed["rank"].extend(np.repeat(np.array([rank for _, rank, _ in decoded], dtype=np.int64), counts))
        fixed["host"].extend(np.repeat(np.array([host for _, _, host in decoded], dtype=np.int64), counts))
        for name in _STEP_PARTS:
            fixed[name].extend_many([getattr(columns, name) for columns, _, _ in decoded])
        named: dict[str, list[tuple[int, Any]]] = {}  # column -> (first row, values) of each record holding it
        missing: dict[str, list[tuple[int, Any]]] = {}
        row = first
        for columns, _, _ in decoded:
            for name, values in columns.phases.items():
                named.setdefault(f"phase_{name}", []).append((row, values))
            for name, values in columns.metrics.items():
                named.setdefault(f"metric_{name}", []).append((row, values))
                gaps = columns.metrics_missing.get(name)
                missing.setdefault(f"metric_{name}", []).append(
                    (row, np.zeros(columns.count, dtype=np.bool_) if gaps is None else gaps))
            for name, digests in columns.rng.items():
                named.setdefault(f"rng_{name}", []).append((row, digests))
            row += columns.count
        for name, pieces in named.items():
            column = self._named(name, *((np.uint8, 0, RNG_DIGEST_BYTES) if name.startswith("rng_")
                                         else (np.float64, np.nan)))
            column.extend_runs(pieces)
        for name, pieces in missing.items():
            if name not in self.missing:
                self.missing[name] = Growing(np.bool_, self.capacity, fill=True)
            self.missing[name].extend_runs(pieces)
        self.rows = row
        self.added = row - first

    def flush(self) -> None:
        """Close the window before the next manifest's rows would likely take it past ``WINDOW_ROWS``."""
        if self.rows and self.rows + self.added > self.WINDOW_ROWS:
            self._close_window()

    def _close_window(self) -> None:
        if not self.rows:
            return
        rows = self.rows
        parts = {name: column.values(rows) for name, column in self.fixed.items()}
        no_batch = parts["batch_size"] < 0
        np.floor_divide(parts["start_ns"], 1000, out=parts["start_ns"])  # microseconds, in place
        arrays = {name: pa.array(parts[name]) for name in ("run", "checkpoint", "rank", "host", "step")}
        arrays.update({
            "start": pa.array(parts["start_ns"]).view(TIME), "duration_s": pa.array(parts["duration_s"]),
            "batch": pa.Array.from_buffers(pa.binary(16), rows, [_validity(~no_batch), pa.py_buffer(parts["batch"])]),
            "batch_size": pa.array(parts["batch_size"], mask=no_batch),
            "batch_kind": pa.array(parts["batch_kind"].view(np.int8)),
        })
        for name, column in self.named.items():
            values = column.values(rows)
            if name.startswith("rng_"):  # a generator's digest at each step's start, null where unread
                read = np.asarray(values.any(axis=1), dtype=bool)
                arrays[name] = pa.Array.from_buffers(pa.binary(16), rows, [_validity(read), pa.py_buffer(values)])
            elif name in self.missing:
                arrays[name] = pa.array(values, mask=self.missing[name].values(rows))
            else:  # one isnan a column and window, not one a rank record
                arrays[name] = pa.array(values, mask=np.isnan(values))
        self.chunks.append((rows, arrays))
        self.capacity = rows + self.added  # the next window's rows, likely: a manifest's more than this one's
        self._start_window()

    #: The columns every steps table has, first.
    FIXED = ("run", "checkpoint", "rank", "host", "step", "start", "duration_s", "batch", "batch_size", "batch_kind")

    @classmethod
    def ordered(cls, met: Iterable[str]) -> list[str]:
        """The table's columns, of those ``met`` (in the order met): the fixed ones, then metrics and
        generators by name, then phases in the order met (the straggler analysis sums them in that order)."""
        extra = [name for name in dict.fromkeys(met) if name not in cls.FIXED]
        return [*cls.FIXED, *sorted(n for n in extra if not n.startswith("phase_")),
                *(n for n in extra if n.startswith("phase_"))]

    def table(self) -> pa.Table:
        self._close_window()
        names = self.ordered(name for _, arrays in self.chunks for name in arrays)
        dictionary = pa.array(list(self.words.ids), pa.string())
        types = {"run": _WORDS, "checkpoint": _WORDS, "host": _WORDS, "rank": pa.int64(), "step": pa.int64(),
                 "start": TIME, "duration_s": pa.float64(), "batch": pa.binary(16), "batch_size": pa.int64(),
                 "batch_kind": pa.int8()}
        columns = {}
        for name in names:
            type_ = types.get(name, pa.binary(16) if name.startswith("rng_") else pa.float64())
            pieces = []
            for rows, arrays in self.chunks:
                array = arrays.get(name)
                if array is None:
                    array = pa.nulls(rows, type_)
                elif type_ == _WORDS:  # word ids: every one in the dictionary (not read again to check)
                    array = pa.DictionaryArray.from_arrays(array, dictionary, safe=False)
                pieces.append(array)
            columns[name] = pa.chunked_array(pieces, type=type_)
        return pa.table(columns)


#: The arrays a steps table takes from each step record (StepColumns fields).
_STEP_PARTS = ("step", "start_ns", "duration_s", "batch", "batch_size", "batch_kind")
#: A window's fixed columns: (name, numpy type, values a row); run, checkpoint and host as word ids.
_STEP_COLUMNS = (("run", np.int32, 1), ("checkpoint", np.int32, 1), ("rank", np.int64, 1), ("host", np.int32, 1),
                 ("step", np.int64, 1), ("start_ns", np.int64, 1), ("duration_s", np.float64, 1),
                 ("batch", np.uint8, BATCH_DIGEST_BYTES), ("batch_size", np.int64, 1), ("batch_kind", np.uint8, 1))
_WORDS = pa.dictionary(pa.int32(), pa.string())


class Growing:
    """A column's values appended in place (a window of ``Steps``): a numpy buffer, doubled when full,
    of ``width`` values a row; rows skipped (a phase first met after some steps) hold ``fill``."""

    def __init__(self, dtype: Any, capacity: int, width: int = 1, fill: Any = 0):
        self.blank, self.size = fill, 0
        self.array = np.empty((capacity, width) if width > 1 else capacity, dtype)

    def _reserve(self, end: int) -> None:
        if end > len(self.array):
            grown = np.empty((max(end, 2 * len(self.array)), *self.array.shape[1:]), self.array.dtype)
            grown[:self.size] = self.array[:self.size]
            self.array = grown

    def _pad(self, row: int) -> None:
        """``fill`` up to ``row``."""
        if row > self.size:
            self._reserve(row)
            self.array[self.size:row] = self.blank
            self.size = row

    def fill(self, value: Any, count: int) -> None:
        """``count`` rows of ``value``."""
        self._reserve(self.size + count)
        self.array[self.size:self.size + count] = value
        self.size += count

    def extend(self, values: np.ndarray) -> None:
        """The rows of ``values``, copied."""
        self.extend_many([values])

    def extend_many(self, arrays: Sequence[np.ndarray]) -> None:
        """The rows of ``arrays``, one after another, copied in one call."""
        count = sum(len(values) for values in arrays)
        self._reserve(self.size + count)
        if arrays:
            np.concatenate(arrays, out=self.array[self.size:self.size + count], casting="unsafe")
        self.size += count

    def extend_runs(self, pieces: Sequence[tuple[int, np.ndarray]]) -> None:
        """Each (first row, values) of ``pieces`` (rows increasing), the rows between them ``fill``: pieces
        that follow each other with no gap are copied in one call."""
        start = 0
        for end in range(1, len(pieces) + 1):
            if end == len(pieces) or pieces[end][0] != pieces[end - 1][0] + len(pieces[end - 1][1]):
                self._pad(pieces[start][0])
                self.extend_many([values for _, values in pieces[start:end]])
                start = end

    def values(self, rows: int) -> np.ndarray:
        """The first ``rows`` (``fill`` past those added), the buffer cut to them in place (``realloc``: no
        copy; an Arrow array of a view would hold all of the buffer). No view of it may be held then."""
        self._pad(rows)
        if rows < len(self.array):
            self.array.resize((rows, *self.array.shape[1:]), refcheck=False)
        return self.array


def _validity(valid: np.ndarray) -> pa.Buffer:
    """An Arrow validity bitmap (bit i set: row i is not null)."""
    return pa.py_buffer(np.packbits(valid, bitorder="little").tobytes())


class System:
    """One row per system sample of a rank (spec 9.4 ``system``, format 1.4), with a column per field met
    anywhere in the run, null where a sample lacked it. Built from whole arrays, like ``Steps``."""

    reads_history = True

    def __init__(self, words: Sequence[str] = ()):
        self.words = Words(words)
        self.repeats: list[tuple[int, int, int, int, float, int]] = []  # run, checkpoint, rank, host, interval, rows
        self.times: list[np.ndarray] = []
        self.named: dict[str, list[tuple[int, np.ndarray]]] = {}
        self.rows = 0

    def add(self, run: str, record: Saved, manifest: Saved, where: str) -> None:
        for columns, rank, rank_record in records_holding(manifest, where, "system", decode_samples):
            interval = np.nan if columns.interval_s is None else columns.interval_s
            self.repeats.append((self.words.id(run), self.words.id(record.name), rank,
                                 self.words.id(str(rank_record.get("host"))), interval, columns.count))
            self.times.append(columns.time_ns)
            for name, values in columns.fields.items():
                self.named.setdefault(name, []).append((self.rows, values))
            self.rows += columns.count

    def flush(self) -> None:
        """Rows are arrays already."""

    #: The columns every system table has, first.
    FIXED = ("run", "checkpoint", "rank", "host", "time", "interval_s")

    @classmethod
    def ordered(cls, met: Iterable[str]) -> list[str]:
        """The table's columns, of those ``met``: the fixed ones, then the samples' fields by name."""
        return [*cls.FIXED, *sorted(set(met) - set(cls.FIXED))]

    def table(self) -> pa.Table:
        repeats = np.array([r[:4] + (r[5],) for r in self.repeats], dtype=np.int64).reshape(-1, 5)
        intervals = np.repeat(np.array([r[4] for r in self.repeats], dtype=np.float64), repeats[:, 4])
        columns = {name: self.words.encode(np.repeat(repeats[:, column], repeats[:, 4]).astype(np.int32))
                   for column, name in ((0, "run"), (1, "checkpoint"))}
        columns["rank"] = pa.array(np.repeat(repeats[:, 2], repeats[:, 4]), pa.int64())
        columns["host"] = self.words.encode(np.repeat(repeats[:, 3], repeats[:, 4]).astype(np.int32))
        times = np.concatenate(self.times) if self.times else np.array([], np.int64)
        columns["time"] = pa.array(times // 1000).view(TIME)
        columns["interval_s"] = pa.array(intervals, mask=np.isnan(intervals))
        for name in self.ordered(self.named)[len(self.FIXED):]:
            values = np.full(self.rows, np.nan)
            for start, piece in self.named[name]:
                values[start:start + len(piece)] = piece
            columns[name] = pa.array(values, mask=np.isnan(values))
        return pa.table(columns)
