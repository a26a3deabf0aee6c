"""How the analytics tables are built: each run's checkpoints are read (commit records and manifests,
and the history objects of removed checkpoints, spec 4.5), several at a time (remote stores answer
slowly, and the window of manifests in flight is bounded), and each is given to the nine table
builders (``table_rows``, ``table_timing``, ``table_environment``). A long run's checkpoints are
shared out, in order, among a process per core (``processes.py``; a child runs ``table_worker``),
whose tables are joined (``table_join``).
"""

from __future__ import annotations

import itertools
import os
import pickle
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from ckptfmt.analytics.processes import TableProcess, TaskRefused, children_possible, usable_cores
from ckptfmt.analytics.table_columns import TABLE_NAMES, TableBuilder
from ckptfmt.analytics.table_environment import Environment, EnvironmentFields
from ckptfmt.analytics.table_join import joined
from ckptfmt.analytics.table_rows import Checkpoints, Resumes, Saves, Tensors, TensorStatsTable
from ckptfmt.analytics.table_timing import Steps, System
from ckptfmt.format.history import History, HistoryKey
from ckptfmt.format.manifest import Manifest, optional_fields_except
from ckptfmt.repository.history import read_histories, removed_histories
from ckptfmt.repository.repository import CommitRecord, Repository
from ckptfmt.storage.factory import in_process_memory

#: Manifests read at once from remote stores (and so the most held in memory before they are added).
#: Local disks answer at once: parsing is the work there, and threads only contend for the GIL.
READ_WORKERS, LOCAL_READ_WORKERS = 16, 2
#: Manifest fields no table uses (nor compare, but where a seed's verdict needs them): RNG states are most
#: of a many-rank manifest's parse time.
SKIPPED_FIELDS = optional_fields_except("environment", "topology", "timing", "stats", "provenance", "replicas")


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
                                    EnvironmentFields(environment), System(words), TensorStatsTable(), Resumes()]
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
