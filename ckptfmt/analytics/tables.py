"""A run's metadata as Arrow tables: checkpoints, saves, steps, tensors, environment, system and
tensor statistics (spec/ANALYTICS.md).

``tables(repos)`` reads every committed checkpoint's commit record and manifest,
and the history objects of removed checkpoints (spec 4.5: their saves, steps and
system samples), several at a time (remote stores answer slowly, and the window
of manifests in flight is bounded), and appends each to nine table builders (``build``: for
``tables``, every checkpoint; for ``export_incremental``, the new ones); a long run's checkpoints
are shared out, in order, among a process per core (``processes.py``), whose tables are joined. Columns of
numbers are built as arrays, the rest as Python lists converted to Arrow a batch
of rows at a time; a value of the wrong type in a hostile manifest is found then
and named with its checkpoint and rank.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import os
import pickle
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from ckptfmt.analytics.processes import TableProcess, TaskRefused, children_possible, usable_cores
from ckptfmt.errors import ManifestError, quoted
from ckptfmt.format.history import History, HistoryKey
from ckptfmt.format.manifest import Manifest, optional_fields_except
from ckptfmt.format.shards import chunk_rows
from ckptfmt.format.tensor_stats import FLOAT_FIELDS
from ckptfmt.metadata.rng_digests import RNG_DIGEST_BYTES
from ckptfmt.metadata.step_timer import BATCH_DIGEST_BYTES, decode_steps
from ckptfmt.metadata.system import decode_samples
from ckptfmt.repository.history import read_histories, removed_histories
from ckptfmt.repository.repository import CommitRecord, Repository
from ckptfmt.storage.factory import in_process_memory

TABLE_NAMES = ("checkpoints", "saves", "steps", "tensors", "environment", "environments", "system", "tensor_stats",
               "resumes")
#: Manifests read at once from remote stores (and so the most held in memory before they are added).
#: Local disks answer at once: parsing is the work there, and threads only contend for the GIL.
READ_WORKERS, LOCAL_READ_WORKERS = 16, 2
#: Flattened environment values longer than this are cut (a hostile manifest's megabyte string).
MAX_VALUE_CHARS = 4096
#: Wall-clock times: microseconds (a nanosecond timestamp becomes no Python datetime without pandas).
_TIME = pa.timestamp("us", tz="UTC")
#: Manifest fields no table uses (nor compare, but where a seed's verdict needs them): RNG states are most
#: of a many-rank manifest's parse time.
SKIPPED_FIELDS = optional_fields_except("environment", "topology", "timing", "stats", "provenance", "replicas")


def tables(repos: str | os.PathLike | Iterable | Mapping[str, str | os.PathLike], *,
           storage_options: dict | None = None, workers: int | None = None,
           processes: int | None = None) -> dict[str, pa.Table]:
    """The metadata of every committed checkpoint of ``repos`` as Arrow tables, by name (``TABLE_NAMES``).

    ``repos``: one repository URL, several, or a mapping of run label -> URL
    (without labels, a run is labelled by its URL). Checkpoints come in commit order.
    ``workers``: manifests read at once by each process (default: 16 from remote stores, 2 from local disks).
    ``processes``: processes building the tables, each from its share of the checkpoints (default: one
    per core, and no more than one per ``SHARE_MIN`` checkpoints; 1 builds them all in this process).
    """
    opened = [(run, Repository.open(url, storage_options)) for run, url in runs(repos)]
    return build([(run, repo, saved(repo)) for run, repo in opened], workers, storage_options=storage_options,
                 processes=processes)


def build(items: Iterable[tuple[str, Repository, Sequence[CommitRecord | HistoryKey]]],
          workers: int | None = None, *, storage_options: dict | None = None,
          processes: int | None = None) -> dict[str, pa.Table]:
    """The tables of the chosen checkpoints of each run, given as (run label, repository, commit records
    and history keys from ``saved``): ``tables`` passes every checkpoint, an incremental export the new ones.

    With more than one process, the checkpoints are cut in order into shares; this process builds the
    first while children (``processes``) build the others from the same URLs and ``storage_options``,
    and the shares' tables are joined in order: the same rows, columns and order as one process gives."""
    items = list(items)
    count = sum(len(chosen) for _, _, chosen in items)
    processes = max(1, min(processes or usable_cores(), count // SHARE_MIN))
    if not children_possible() or any(in_process_memory(repo.url) for _, repo, _ in items):
        processes = 1  # no child can start here, or a memory:// repository lives in this process only
    shares = _shares(items, processes)
    words = seed_words(items)
    if len(shares) == 1:
        return _build_here(items, workers, words)
    try:
        tasks = [pickle.dumps(([(run, repo.url, chosen) for run, repo, chosen in share], storage_options, workers,
                               words)) for share in shares[1:]]
    except (pickle.PicklingError, TypeError, AttributeError):  # storage options a child cannot be given
        return _build_here(items, workers, words)
    children: list[TableProcess] = []
    try:
        try:
            children.extend(TableProcess(WORKER_MODULE, task) for task in tasks)
        except OSError:  # no child can start here (no interpreter, descriptors or processes left)
            return _build_here(items, workers, words)
        built = [_build_here(shares[0], workers, words)]
        for share, child in zip(shares[1:], children):
            try:
                built.append(child.result())
            except TaskRefused:  # an object of the storage options only this process can rebuild
                built.append(_build_here(share, workers, words))
    finally:
        for child in children:
            child.stop()
    return joined(built)


def seed_words(items: Iterable[tuple[str, Repository, Sequence[CommitRecord | HistoryKey]]]) -> list[str]:
    """The words every share's dictionaries start with, in order: each run's label and its checkpoints'
    names. Shares that meet the hosts in the same order (ranks in order) then have the same dictionary,
    and ``joined`` keeps their indices as they are (no copy, and no page of a child's tables touched)."""
    return list(dict.fromkeys(word for run, _, chosen in items for word in (run, *(item.name for item in chosen))))


def joined(built: Sequence[Mapping[str, pa.Table]]) -> dict[str, pa.Table]:
    """The tables of shares of checkpoints (in order) as one process builds them all: rows in order,
    every column met in any share (null where a share had none) in the table's order, each distinct
    environment once, and one dictionary per text column."""
    result = {}
    for name in TABLE_NAMES:
        pieces = [tables[name] for tables in built]
        met = [column for piece in pieces for column in piece.column_names]
        order = Steps.ordered(met) if name == "steps" else System.ordered(met) if name == "system" \
            else list(dict.fromkeys(met))
        types = {field.name: field.type for piece in reversed(pieces) for field in piece.schema}
        pieces = [pa.table({column: piece[column] if column in piece.column_names
                            else pa.nulls(piece.num_rows, types[column]) for column in order}) for piece in pieces]
        if name == "environments":
            pieces = _first_of_each_environment(pieces)
        table = pa.concat_tables(pieces)
        for index, field in enumerate(table.schema):
            if pa.types.is_dictionary(field.type):
                table = table.set_column(index, field, _one_dictionary(table.column(index)))
        result[name] = table
    return result


def _one_dictionary(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """A dictionary column's chunks over one dictionary: the first chunk's, then the words later chunks add.
    A chunk whose dictionary starts that one keeps its indices (shares seeded with the same words mostly
    have the same dictionary: ``seed_words``); others' are mapped (``unify_dictionaries`` maps every chunk's,
    a copy of each share's indices, and touches every page of the children's)."""
    if column.num_chunks <= 1:
        return column
    ids: dict[Any, int] = {}
    mappings: list[tuple[pa.Array, np.ndarray | None]] = []  # each distinct dictionary, and its ids (None: the same)
    chunks = []
    for chunk in column.chunks:
        dictionary = chunk.dictionary
        mapping = next((m for d, m in mappings if d is dictionary or d.equals(dictionary)), False)
        if mapping is False:
            values = dictionary.to_pylist()
            mapped = np.fromiter((ids.setdefault(value, len(ids)) for value in values), np.int32, len(values))
            mapping = None if np.array_equal(mapped, np.arange(len(values))) else mapped
            mappings.append((dictionary, mapping))
        chunks.append(chunk.indices if mapping is None else pc.take(pa.array(mapping, pa.int32()), chunk.indices))
    words = pa.array(list(ids), column.type.value_type)
    # Not checked again (safe=False): checking reads every index, every page of a child's tables.
    return pa.chunked_array([pa.DictionaryArray.from_arrays(indices.cast(column.type.index_type), words, safe=False)
                             for indices in chunks], column.type)


def _first_of_each_environment(pieces: list[pa.Table]) -> list[pa.Table]:
    """``environments`` rows of shares, an environment's rows kept from the first share that has it."""
    seen: set[int] = set()
    kept = []
    for piece in pieces:
        if seen:
            piece = piece.filter(pc.invert(pc.is_in(piece["environment_id"], pa.array(sorted(seen), pa.int64()))))
        kept.append(piece)
        seen.update(piece["environment_id"].unique().to_pylist())
    return kept


def build_share(task: tuple) -> dict[str, pa.Table]:
    """A child's share (``table_worker``): (run, URL, chosen) of each run, the storage options, workers."""
    share, storage_options, workers, words = task
    return _build_here([(run, Repository.open(url, storage_options), chosen) for run, url, chosen in share], workers,
                       words)


#: The module whose ``main(fd)`` a child runs (``processes.TableProcess``).
WORKER_MODULE = "ckptfmt.analytics.table_worker"
#: The fewest checkpoints a process is given: a child's start (about 0.3 s) is worth a few hundred ms of work.
SHARE_MIN = 64
#: How much more this process builds than each child: a child starts (0.3 s) and writes its tables
#: (0.2 s for half of bench/analytics.py's run), while this process has its share done by then.
FIRST_SHARE_EXTRA = 0.2


def _shares(items: Sequence[tuple[str, Repository, Sequence[CommitRecord | HistoryKey]]],
            count: int) -> list[list[tuple[str, Repository, Sequence[CommitRecord | HistoryKey]]]]:
    """``items`` cut into ``count`` shares of checkpoints in order, as equal as whole checkpoints allow."""
    total = sum(len(chosen) for _, _, chosen in items)
    if count <= 1 or total == 0:
        return [list(items)]
    # The first share (this process's) is larger by FIRST_SHARE_EXTRA: a child pays its start and its tables' copy.
    weights = [1 + FIRST_SHARE_EXTRA] + [1.0] * (count - 1)
    ends = [round(sum(weights[:share + 1]) * total / sum(weights)) for share in range(count)]  # after each share
    shares: list[list] = [[] for _ in range(count)]
    share = position = 0
    for run, repo, chosen in items:
        start = 0
        while start < len(chosen):
            while position >= ends[share]:
                share += 1
            end = start + min(len(chosen) - start, ends[share] - position)
            shares[share].append((run, repo, chosen[start:end]))
            position += end - start
            start = end
    return [share for share in shares if share]


def _build_here(items: Iterable[tuple[str, Repository, Sequence[CommitRecord | HistoryKey]]],
                workers: int | None, words: Sequence[str] = ()) -> dict[str, pa.Table]:
    """The tables of ``items``, built in this process; ``words`` start the dictionaries of ``steps`` and
    ``system`` (``seed_words``)."""
    environment = Environment()
    builders: list[TableBuilder] = [Checkpoints(), Saves(), Steps(words), Tensors(), environment,
                                    EnvironmentFields(environment), System(words), TensorStats(), Resumes()]
    for run, repo, chosen in items:
        readers = workers or (LOCAL_READ_WORKERS if repo.storage.cheap_exists else READ_WORKERS)
        for record, manifest in _manifests(repo, chosen, readers):
            removed = isinstance(manifest, History)  # its record and manifest are the history object
            where = repo.storage.describe(record.name) + (" (removed: its history object)" if removed else "")
            for builder in builders:
                if not removed or builder.reads_history:
                    builder.add(run, record, manifest, where)
                    builder.flush()
    return {name: builder.table() for name, builder in zip(TABLE_NAMES, builders)}


def export(built: Mapping[str, pa.Table], out: str | os.PathLike, fmt: str = "parquet") -> list[Path]:
    """Write each table as ``OUT/<name>.parquet`` or ``.csv`` (lists and bytes become text in CSV)."""
    if fmt not in ("parquet", "csv"):
        raise ValueError(f"format must be parquet or csv, not {fmt!r}")
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, table in built.items():
        path = folder / f"{name}.{fmt}"
        if fmt == "parquet":
            pq.write_table(table, path)
        else:
            pa_csv.write_csv(_flat_for_csv(table), path)
        paths.append(path)
    return paths


# -- reading -----------------------------------------------------------------------------------
def runs(repos) -> list[tuple[str, str]]:
    """(label, URL) of each run of ``repos`` as ``tables`` takes them."""
    if isinstance(repos, (str, os.PathLike)):
        return [(os.fspath(repos), os.fspath(repos))]
    if isinstance(repos, Mapping):
        return [(str(label), os.fspath(url)) for label, url in repos.items()]
    return [(os.fspath(url), os.fspath(url)) for url in repos]


def saved(repo: Repository) -> list[CommitRecord | HistoryKey]:
    """Every committed checkpoint's record and every removed checkpoint's history key (spec 4.5), in the
    order they were saved."""
    records = repo.commits()
    return sorted([*records, *removed_histories(repo, records)], key=lambda item: (item.created_ns, item.name))


def _manifests(repo: Repository, items: Sequence[CommitRecord | HistoryKey],
               workers: int) -> Iterator[tuple[CommitRecord | History, Manifest | History]]:
    """The manifest of each committed checkpoint of ``items`` with its record, and each removed
    checkpoint's history object as both, in order, ``workers`` read at a time. A damaged history
    object is skipped with a warning (``ckptfmt verify`` names it)."""
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ckptfmt-analytics") as pool:
        pending = iter(items)
        def read(item: CommitRecord | HistoryKey) -> Manifest | History | None:
            if isinstance(item, HistoryKey):
                found = read_histories(repo, [item])
                return found[0] if found else None
            return repo.manifest(item.name, item, skip=SKIPPED_FIELDS)
        window = [pool.submit(read, item) for item in itertools.islice(pending, workers)]
        for item in items:
            manifest = window.pop(0).result()
            following = next(pending, None)
            if following is not None:
                window.append(pool.submit(read, following))
            if isinstance(manifest, History):
                yield manifest, manifest
            elif manifest is not None:
                assert isinstance(item, CommitRecord)
                yield item, manifest


# -- building columns --------------------------------------------------------------------------
class TableBuilder(Protocol):
    """What builds one of the tables, a manifest at a time."""

    #: Whether it takes removed checkpoints' history objects too (as both record and manifest).
    reads_history: bool

    def add(self, run: str, record: Any, manifest: Any, where: str) -> None: ...

    def flush(self) -> None: ...

    def table(self) -> pa.Table: ...


class _Builder:
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
            if type_ == _TIME:  # nanoseconds as int64 until now: one conversion for the whole column
                nanoseconds = pa.chunked_array([b[name] for b in self.batches], pa.int64()).combine_chunks()
                columns.append(pc.divide(nanoseconds, 1000).view(_TIME))
            else:
                columns.append(pa.chunked_array([b[name] for b in self.batches], type_))
        return pa.Table.from_arrays(columns, names=[name for name, _ in self.fields])

    def _array(self, name: str, type_: pa.DataType, values: list) -> pa.Array:
        type_ = pa.int64() if type_ == _TIME else type_
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


def _map(value: Any, where: str, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ManifestError(f"{where}: {what} is a {type(value).__name__}, not a map")
    return value


def _list(value: Any, where: str, what: str) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ManifestError(f"{where}: {what} is a {type(value).__name__}, not an array")
    return value


def _rank_records(manifest: Manifest | _Saved, where: str) -> list[dict]:
    records = _list(_map(manifest.timing, where, "timing").get("ranks"), where, "timing.ranks")
    for index, record in enumerate(records):
        _map(record, where, f"timing.ranks[{index}]")
    return records


# -- the tables --------------------------------------------------------------------------------
class Checkpoints(_Builder):
    """One row per checkpoint."""

    fields = (("run", pa.string()), ("name", pa.string()), ("step", pa.int64()), ("created", _TIME),
              ("parent", pa.string()), ("world_size", pa.int64()), ("tensor_count", pa.int64()),
              ("tensor_bytes", pa.int64()), ("chunk_count", pa.int64()), ("stored_bytes", pa.int64()),
              ("new_bytes", pa.int64()), ("manifest_bytes", pa.int64()), ("save_s", pa.float64()),
              ("format_version", pa.string()))

    def add(self, run: str, record: CommitRecord, manifest: Manifest, where: str) -> None:
        self.origin(where)
        counts = _map(manifest.totals, where, "stats")
        recorded = [r.get("total_s") for r in _rank_records(manifest, where)]
        totals = [t for t in recorded if isinstance(t, (int, float)) and not isinstance(t, bool)]
        topology = _map(manifest.topology, where, "topology")
        row = {
            "run": run, "name": record.name, "step": record.step, "created": record.created_ns,
            "parent": record.parent, "world_size": topology.get("world_size"),
            **{k: counts.get(k) for k in ("tensor_count", "tensor_bytes", "chunk_count", "stored_bytes", "new_bytes")},
            "manifest_bytes": record.manifest_size, "save_s": max(totals) if totals else None,
            "format_version": ".".join(map(str, manifest.version)),
        }
        for name, column in self.columns.items():
            column.append(row[name])
        self.rows += 1


class _Saved(Protocol):
    """What the history tables read of a save: a commit record, or a removed checkpoint's history object."""

    @property
    def name(self) -> str: ...

    @property
    def step(self) -> int | None: ...

    @property
    def timing(self) -> dict: ...


class Saves(_Builder):
    """One row per save, rank and save phase, removed checkpoints' saves included."""

    reads_history = True

    fields = (("run", pa.string()), ("name", pa.string()), ("step", pa.int64()), ("rank", pa.int64()),
              ("host", pa.string()), ("phase", pa.string()), ("start", _TIME), ("duration_s", pa.float64()),
              ("rank_total_s", pa.float64()))

    def add(self, run: str, record: _Saved, manifest: _Saved, where: str) -> None:
        self.origin(where)
        columns = self.columns
        for index, rank_record in enumerate(_rank_records(manifest, where)):
            phases = [_map(phase, where, f"timing.ranks[{index}].phases[{position}]") for position, phase
                      in enumerate(_list(rank_record.get("phases"), where, f"timing.ranks[{index}].phases"))]
            count = len(phases)
            for name, value in (("run", run), ("name", record.name), ("step", record.step),
                                ("rank", rank_record.get("rank")), ("host", rank_record.get("host")),
                                ("rank_total_s", rank_record.get("total_s"))):
                columns[name].extend([value] * count)
            for name, field in (("phase", "name"), ("start", "start_ns"), ("duration_s", "duration_s")):
                columns[name].extend([phase.get(field) for phase in phases])
            self.rows += count


class Resumes(_Builder):
    """One row per resume, rank and part of the state compared (spec 9.4 ``resumes``), removed
    checkpoints' records included; a resume that compared no part has one row with no part."""

    reads_history = True

    fields = (("run", pa.string()), ("checkpoint", pa.string()), ("rank", pa.int64()), ("from_name", pa.string()),
              ("from_step", pa.int64()), ("from_manifest", pa.string()), ("from_repository", pa.string()),
              ("resumed", _TIME), ("world_size_then", pa.int64()), ("world_size_now", pa.int64()),
              ("part", pa.string()), ("verdict", pa.string()), ("stored", pa.int64()), ("missing", pa.int64()),
              ("different", pa.int64()), ("keys", pa.list_(pa.string())), ("feeds", pa.string()))

    def add(self, run: str, record: _Saved, manifest: _Saved, where: str) -> None:
        self.origin(where)
        for index, rank_record in enumerate(_rank_records(manifest, where)):
            what = f"timing.ranks[{index}].resumes"
            for position, resume in enumerate(_list(rank_record.get("resumes"), where, what)):
                resume = _map(resume, where, f"{what}[{position}]")
                source = _map(resume.get("from"), where, f"{what}[{position}].from")
                sizes = resume.get("world_size")
                then, now = sizes if isinstance(sizes, list) and len(sizes) == 2 else (None, None)
                parts = [_map(part, where, f"{what}[{position}].parts") for part
                         in _list(resume.get("parts"), where, f"{what}[{position}].parts")] or [{}]
                common = {"run": run, "checkpoint": record.name, "rank": resume.get("rank"),
                          "from_name": source.get("name"), "from_step": source.get("step"),
                          "from_manifest": source.get("manifest"), "from_repository": source.get("repository"),
                          "resumed": resume.get("resumed_ns"), "world_size_then": then, "world_size_now": now}
                for part in parts:
                    for name, value in common.items():
                        self.columns[name].append(value)
                    for name in ("part", "verdict", "stored", "missing", "different", "keys", "feeds"):
                        self.columns[name].append(part.get(name))
                    self.rows += 1


class Steps:
    """One row per training step of a rank (spec 9.4), with a column per phase (``phase_<name>``) and per
    metric (``metric_<name>``) met anywhere in the run.

    Step records are bins of little-endian numbers: each is decoded as numpy
    views and copied at once into the window's growing columns (``_Growing``),
    so a manifest is let go as soon as it is added (views kept for a window held
    some 40 manifests' step bytes, and left the heap fragmented around them when
    they went). Every ``WINDOW_ROWS`` rows or so the window's columns become
    Arrow arrays without a copy (a chunk of each column); strings are
    dictionary-encoded (a run's millions of steps share a few names and hosts).
    """

    WINDOW_ROWS = 2**18
    reads_history = True

    def __init__(self, words: Sequence[str] = ()):
        self.words = _Words(words)
        self.chunks: list[tuple[int, dict[str, pa.Array]]] = []  # (rows, arrays)
        self.capacity = 1024  # rows a window's columns start with: the last window's, once there is one
        self._start_window()

    def _start_window(self) -> None:
        self.fixed = {name: _Growing(dtype, self.capacity, width) for name, dtype, width in _STEP_COLUMNS}
        #: phase_<name> (NaN where the step had none: null in the table), metric_<name> (NaN, with
        #: ``missing``) and rng_<generator> (zeros where unread: null), in the order met.
        self.named: dict[str, _Growing] = {}
        self.missing: dict[str, _Growing] = {}  # metric_<name>: True where the step recorded none
        self.rows = 0
        self.added = 0  # the rows of the last manifest added

    def _named(self, name: str, dtype: Any, fill: Any, width: int = 1) -> _Growing:
        column = self.named.get(name)
        if column is None:
            column = self.named[name] = _Growing(dtype, self.capacity, width, fill)
        return column

    def add(self, run: str, record: _Saved, manifest: _Saved, where: str) -> None:
        """A manifest's step records, decoded as views and copied into the window's columns a column at a
        time (a call per column and manifest, not per rank record: 64 ranks' records cost 64 times the
        calls), the views let go when it returns."""
        decoded: list[tuple[Any, int, int]] = []  # (columns, rank, host id) per record with steps
        for index, rank_record in enumerate(_rank_records(manifest, where)):
            if rank_record.get("steps") is None:
                continue
            columns = decode_steps(rank_record["steps"], f"{where}: timing.ranks[{index}].steps")
            rank = rank_record.get("rank")
            if type(rank) is not int:
                raise ManifestError(f"{where}: timing.ranks[{index}].rank is not an int")
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
                self.missing[name] = _Growing(np.bool_, self.capacity, fill=True)
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
            "start": pa.array(parts["start_ns"]).view(_TIME), "duration_s": pa.array(parts["duration_s"]),
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
                 "start": _TIME, "duration_s": pa.float64(), "batch": pa.binary(16), "batch_size": pa.int64(),
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


class _Growing:
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


class _Words:
    """Strings interned as int32 ids, for dictionary-encoded columns."""

    def __init__(self, words: Sequence[str] = ()):
        self.ids: dict[str, int] = {word: index for index, word in enumerate(dict.fromkeys(words))}

    def id(self, word: str) -> int:
        return self.ids.setdefault(word, len(self.ids))

    def encode(self, ids: np.ndarray) -> pa.DictionaryArray:
        return pa.DictionaryArray.from_arrays(pa.array(ids, pa.int32()), pa.array(list(self.ids), pa.string()))


class Tensors(_Builder):
    """One row per checkpoint and tensor: dtype, shape, bytes, shards, and the chunks holding it."""

    fields = (("run", pa.string()), ("name", pa.string()), ("step", pa.int64()), ("key", pa.string()),
              ("dtype", pa.string()), ("shape", pa.list_(pa.int64())), ("nbytes", pa.int64()),
              ("kind", pa.string()), ("shards", pa.int64()), ("same_as", pa.string()),
              ("chunks", pa.list_(pa.string())))

    def add(self, run: str, record: CommitRecord, manifest: Manifest, where: str) -> None:
        self.origin(where)
        chunks = manifest.chunks
        columns = self.columns
        for tensor in manifest.tensors:
            hashes = list(dict.fromkeys(chunks[row].hash for row in chunk_rows(tensor.shards)))
            same_as = None if tensor.same_as is None else manifest.tensors[tensor.same_as].key
            for name, value in (("run", run), ("name", record.name), ("step", record.step), ("key", tensor.key),
                                ("dtype", tensor.dtype), ("shape", list(tensor.shape)), ("nbytes", tensor.nbytes),
                                ("kind", tensor.kind), ("shards", len(tensor.shards)), ("same_as", same_as),
                                ("chunks", hashes)):
                columns[name].append(value)
            self.rows += 1


class System:
    """One row per system sample of a rank (spec 9.4 ``system``, format 1.4), with a column per field met
    anywhere in the run, null where a sample lacked it. Built from whole arrays, like ``Steps``."""

    reads_history = True

    def __init__(self, words: Sequence[str] = ()):
        self.words = _Words(words)
        self.repeats: list[tuple[int, int, int, int, float, int]] = []  # run, checkpoint, rank, host, interval, rows
        self.times: list[np.ndarray] = []
        self.named: dict[str, list[tuple[int, np.ndarray]]] = {}
        self.rows = 0

    def add(self, run: str, record: _Saved, manifest: _Saved, where: str) -> None:
        for index, rank_record in enumerate(_rank_records(manifest, where)):
            if rank_record.get("system") is None:
                continue
            columns = decode_samples(rank_record["system"], f"{where}: timing.ranks[{index}].system")
            rank = rank_record.get("rank")
            if type(rank) is not int:
                raise ManifestError(f"{where}: timing.ranks[{index}].rank is not an int")
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
        columns["time"] = pa.array(times // 1000).view(_TIME)
        columns["interval_s"] = pa.array(intervals, mask=np.isnan(intervals))
        for name in self.ordered(self.named)[len(self.FIXED):]:
            values = np.full(self.rows, np.nan)
            for start, piece in self.named[name]:
                values[start:start + len(piece)] = piece
            columns[name] = pa.array(values, mask=np.isnan(values))
        return pa.table(columns)


_COUNTS = frozenset({"count", "nan", "posinf", "neginf", "zeros"})


class TensorStats(_Builder):
    """One row per checkpoint and tensor with recorded statistics (spec 6.10, format 1.4); a tensor that
    is the same object as an earlier one (``same_as``) is left out, as its statistics are that one's."""

    fields = (("run", pa.string()), ("name", pa.string()), ("step", pa.int64()), ("key", pa.string()),
              ("dtype", pa.string()), *((field, pa.int64() if field in _COUNTS else pa.float64())
                                        for field in FLOAT_FIELDS))

    def add(self, run: str, record: CommitRecord, manifest: Manifest, where: str) -> None:
        self.origin(where)
        columns = self.columns
        for tensor in manifest.tensors:
            if tensor.stats is None or tensor.same_as is not None:
                continue
            for name, value in (("run", run), ("name", record.name), ("step", record.step), ("key", tensor.key),
                                ("dtype", tensor.dtype)):
                columns[name].append(value)
            for field in FLOAT_FIELDS:
                columns[field].append(tensor.stats.get(field))
            self.rows += 1


class Environment:
    """One row per checkpoint and rank: the environment it ran in, as ``environment_id``, whose fields
    are rows of ``environments`` (``EnvironmentFields``). A run's ranks and checkpoints mostly share a
    few environments (spec 9.2): each distinct one is stored once (a thousand checkpoints of 64 ranks
    gave 11 million field rows when every rank's fields were rows of their own)."""

    fields = (("run", pa.string()), ("name", pa.string()), ("step", pa.int64()), ("rank", pa.int64()),
              ("environment_id", pa.int64()))
    reads_history = False

    def __init__(self):
        self.words = _Words()  # every run and name, and every environment's fields and values
        self.parts: dict[str, list[np.ndarray]] = {name: [] for name in [*dict(self.fields), "no_step"]}
        #: Each distinct environment's field and value ids (word ids), by environment id.
        self.environments: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.last: tuple[dict, int] | None = None  # the last environment met, and its id

    def add(self, run: str, record: CommitRecord, manifest: Manifest, where: str) -> None:
        environment = _map(manifest.environment, where, "environment")
        groups = [environment] + [_map(e, where, "environment.others[]")
                                  for e in _list(environment.get("others"), where, "environment.others")]
        for group in groups:
            ranks = group.get("ranks", [0])
            if not isinstance(ranks, list) or not all(type(r) is int for r in ranks):
                raise ManifestError(f"{where}: environment.ranks is not an array of ints")
            identity = self._id({k: v for k, v in group.items() if k not in ("ranks", "others")})
            count = len(ranks)
            self._extend(run=np.full(count, self.words.id(run), np.int32),
                         name=np.full(count, self.words.id(record.name), np.int32),
                         step=np.full(count, record.step or 0, np.int64),
                         no_step=np.full(count, record.step is None),
                         rank=np.array(ranks, dtype=np.int64), environment_id=np.full(count, identity, np.int64))

    def flush(self) -> None:
        """Rows are arrays already."""

    def _id(self, environment: dict) -> int:
        """The id of an environment (``environment_id``); a run's checkpoints mostly repeat the last one."""
        if self.last is not None and self.last[0] == environment:
            return self.last[1]
        flat = sorted(flatten_fields(environment))
        identity = environment_id(flat)
        if identity not in self.environments:
            self.environments[identity] = (np.array([self.words.id(f) for f, _ in flat], dtype=np.int32),
                                           np.array([self.words.id(v) for _, v in flat], dtype=np.int32))
        self.last = (environment, identity)
        return identity

    def _extend(self, **parts: np.ndarray) -> None:
        for name, part in parts.items():
            self.parts[name].append(part)

    def table(self) -> pa.Table:
        parts = {name: np.concatenate(p) if p else np.array([], np.int32) for name, p in self.parts.items()}
        arrays = []
        for name, type_ in self.fields:
            part = parts[name]
            if type_ == pa.string():
                arrays.append(self.words.encode(part))
            elif name == "step":
                arrays.append(pa.array(part, pa.int64(), mask=parts["no_step"].astype(bool)))
            else:
                arrays.append(pa.array(part, type_))
        return pa.Table.from_arrays(arrays, names=[name for name, _ in self.fields])


class EnvironmentFields:
    """The ``environments`` table: one row per distinct environment and dotted field, its value as text
    (the environments ``Environment`` met, by its ``environment_id``)."""

    fields = (("environment_id", pa.int64()), ("field", pa.string()), ("value", pa.string()))
    reads_history = False

    def __init__(self, environment: Environment):
        self.environment = environment

    def add(self, run: str, record: CommitRecord, manifest: Manifest, where: str) -> None:
        """``Environment`` reads the manifests."""

    def flush(self) -> None:
        """Rows are arrays already."""

    def table(self) -> pa.Table:
        found = self.environment.environments
        ids = np.repeat(np.fromiter(found, np.int64, len(found)), [len(fields) for fields, _ in found.values()])
        fields = np.concatenate([f for f, _ in found.values()]) if found else np.array([], np.int32)
        values = np.concatenate([v for _, v in found.values()]) if found else np.array([], np.int32)
        words = self.environment.words
        return pa.Table.from_arrays([pa.array(ids, pa.int64()), words.encode(fields), words.encode(values)],
                                    names=[name for name, _ in self.fields])


def environment_id(fields: list[tuple[str, str]]) -> int:
    """An environment's id, the same in every call and run: BLAKE2b with an 8-byte digest over the JSON
    text of its sorted ``[field, value]`` pairs, as a big-endian signed int64 (spec/ANALYTICS.md)."""
    text = json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big", signed=True)


def flatten_fields(value: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted field, value as text) for every leaf of a metadata map; lists are indexed (gpus.0.name)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from flatten_fields(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from flatten_fields(item, f"{prefix}.{index}" if prefix else str(index))
    else:
        yield prefix, _text(value)


def _text(value: Any) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, bytes):
        text = value.hex()
    else:
        text = json.dumps(value)
    return text[:MAX_VALUE_CHARS]


def _flat_for_csv(table: pa.Table) -> pa.Table:
    """CSV holds no lists or bytes: lists become JSON text, bytes hex."""
    for index, field in enumerate(table.schema):
        column = table.column(index)
        if pa.types.is_list(field.type):
            text = pa.array([None if v is None else json.dumps(v) for v in column.to_pylist()], pa.string())
        elif pa.types.is_binary(field.type) or pa.types.is_fixed_size_binary(field.type):
            text = pa.array([None if v is None else v.hex() for v in column.to_pylist()], pa.string())
        elif pa.types.is_dictionary(field.type):
            text = column.cast(pa.string())
        else:
            continue
        table = table.set_column(index, field.name, text)
    return table

