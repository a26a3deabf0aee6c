"""A run's metadata as Arrow tables: checkpoints, saves, steps, tensors, environment, system and
tensor statistics (spec/ANALYTICS.md).

``tables(repos)`` reads every committed checkpoint's commit record and manifest, and the history
objects of removed checkpoints (spec 4.5: their saves, steps and system samples), and appends each
to nine table builders. The work is shared out by job:

- ``table_build``: the build (``build``: for ``tables``, every checkpoint; for
  ``export_incremental``, the new ones): manifests read several at a time, a long run's
  checkpoints shared out, in order, among a process per core (``processes.py``, ``table_worker``);
- ``table_join``: the tables of those shares joined into one process's;
- the builders: ``table_columns`` (what they share: columns of numbers built as arrays, the rest as
  Python lists converted to Arrow a batch of rows at a time, a value of the wrong type in a hostile
  manifest found then and named with its checkpoint and rank), ``table_rows`` (checkpoints, saves,
  resumes, tensors, tensor statistics), ``table_timing`` (steps, system) and ``table_environment``;
- ``table_export``: the tables written as Parquet or CSV files (``dataset.py``: a dataset that grows).

The names of those modules are importable from here too, as before they were split; a test that
replaces one (``monkeypatch``) replaces it in the module that uses it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping

import pyarrow as pa

from ckptfmt.analytics.table_build import (
    FIRST_SHARE_EXTRA,
    LOCAL_READ_WORKERS,
    READ_WORKERS,
    SHARE_MIN,
    SKIPPED_FIELDS,
    WORKER_MODULE,
    build,
    build_share,
    runs,
    saved,
    seed_words,
)
from ckptfmt.analytics.table_columns import TABLE_NAMES, TableBuilder
from ckptfmt.analytics.table_environment import (
    MAX_VALUE_CHARS,
    Environment,
    EnvironmentFields,
    environment_id,
    flatten_fields,
)
from ckptfmt.analytics.table_export import export
from ckptfmt.analytics.table_join import joined
from ckptfmt.analytics.table_rows import Checkpoints, Resumes, Saves, Tensors, TensorStatsTable
from ckptfmt.analytics.table_timing import Steps, System
from ckptfmt.repository.repository import Repository


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


def __getattr__(name: str) -> type:
    """The builder of the ``tensor_stats`` table was ``TensorStats`` here, a name the TUI's statistics of
    a tensor's values also had (issue 50): the old name warns and works."""
    if name == "TensorStats":
        warnings.warn("ckptfmt.analytics.tables.TensorStats is renamed TensorStatsTable", DeprecationWarning,
                      stacklevel=2)
        return TensorStatsTable
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FIRST_SHARE_EXTRA", "LOCAL_READ_WORKERS", "MAX_VALUE_CHARS", "READ_WORKERS", "SHARE_MIN", "SKIPPED_FIELDS",
    "TABLE_NAMES", "WORKER_MODULE", "Checkpoints", "Environment", "EnvironmentFields", "Resumes", "Saves", "Steps",
    "System", "TableBuilder", "TensorStatsTable", "Tensors", "build", "build_share", "environment_id", "export",
    "flatten_fields", "joined", "runs", "saved", "seed_words", "tables",
]
