"""The ``steps`` table's memory (spec/ANALYTICS.md; issue 49): text columns dictionary-encoded, every column
as narrow as its documented type, no manifest bytes held while the table is built, and the shares of a
multi-process build joined without copying their dictionary indices."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pyarrow as pa

from ckptfmt import analytics
from ckptfmt.repository.repository import Repository
from tests.analytics.test_analytics_tables import train_and_save

#: The modules building the steps table and joining shares' tables.
TIMING = importlib.import_module("ckptfmt.analytics.table_timing")
JOIN = importlib.import_module("ckptfmt.analytics.table_join")
WORDS = pa.dictionary(pa.int32(), pa.string())
#: Bytes a row of each fixed column, as spec/ANALYTICS.md types it (a dictionary column: its int32 index).
WIDTHS = {"run": 4, "checkpoint": 4, "rank": 8, "host": 4, "step": 8, "start": 8, "duration_s": 8, "batch": 16,
          "batch_size": 8, "batch_kind": 1}


def documented_bytes(table: pa.Table) -> float:
    """The bytes ``table`` takes as documented: each row's values at their types' widths and a validity bit
    a column, each chunk's dictionaries, and a few bytes of padding a buffer."""
    total = 0.0
    for name, column in zip(table.column_names, table.columns):
        width = WIDTHS.get(name, 16 if name.startswith("rng_") else 8)  # phase_, metric_: float64
        total += table.num_rows * (width + 1 / 8)
        for chunk in column.chunks:
            total += 3 * 8 + (chunk.dictionary.nbytes if pa.types.is_dictionary(chunk.type) else 0)
    return total


def test_the_steps_table_takes_the_bytes_its_types_say(tmp_path):
    repo = str(tmp_path / "run")
    train_and_save(repo, checkpoints=3, steps_each=40)
    steps = analytics.tables(repo, processes=1)["steps"]
    assert steps.num_rows == 120
    for name in ("run", "checkpoint", "host"):
        assert steps.schema.field(name).type == WORDS, name
    assert steps.nbytes <= documented_bytes(steps)
    # Text as plain strings would take 4 bytes of offset and the characters, a row: far above the bound.
    assert steps.column("checkpoint").cast(pa.string()).nbytes > 2 * steps.column("checkpoint").nbytes
    plain = steps.column("checkpoint").cast(pa.string()).to_pylist()
    assert plain == ["step-0040"] * 40 + ["step-0080"] * 40 + ["step-0120"] * 40


def test_a_manifest_is_let_go_once_its_steps_are_added(tmp_path):
    repo_url = str(tmp_path / "run")
    train_and_save(repo_url, checkpoints=1, steps_each=8)
    repo = Repository.open(repo_url)
    record = repo.commits()[0]
    manifest = repo.manifest(record.name, record)
    stored = manifest.timing["ranks"][0]["steps"]
    held = {name: sys.getrefcount(stored[name]) for name in ("step", "start_ns", "duration_s", "batch")}
    builder = TIMING.Steps()
    builder.add("run", record, manifest, "here")
    builder.flush()
    # Copied, not viewed: a view would hold each manifest's bytes until its window of rows is closed.
    assert {name: sys.getrefcount(stored[name]) for name in held} == held
    steps = builder.table()
    assert steps.num_rows == 8 and steps.column("step").to_pylist() == list(range(8))


def test_a_window_is_cut_to_its_rows():
    growing = TIMING.Growing(np.int64, 1024)
    growing.extend(np.arange(10))
    values = growing.values(12)
    assert values.tolist() == [*range(10), 0, 0] and values.nbytes == 12 * 8 and values.base is None
    phase = TIMING.Growing(np.float64, 16, fill=np.nan)
    phase.extend_runs([(12, np.ones(2)), (14, np.full(2, 2.0))])  # met from row 12 on, two records in a run
    assert np.isnan(phase.values(16)[:12]).all() and phase.values(16)[12:].tolist() == [1.0, 1.0, 2.0, 2.0]
    gaps = TIMING.Growing(np.float64, 4, fill=np.nan)
    gaps.extend_runs([(1, np.ones(2)), (5, np.full(1, 3.0))])  # rows 0, 3 and 4 fill; the buffer grows
    assert np.array_equal(gaps.values(6), [np.nan, 1, 1, np.nan, np.nan, 3], equal_nan=True)


def test_shares_with_one_dictionary_are_joined_without_copying_their_indices():
    words = ["run", "step-1", "step-2", "node0"]
    first = pa.DictionaryArray.from_arrays(pa.array([0, 1, 3], pa.int32()), pa.array(words))
    same = pa.DictionaryArray.from_arrays(pa.array([0, 2, 3], pa.int32()), pa.array(words))  # another share's
    longer = pa.DictionaryArray.from_arrays(pa.array([4, 2], pa.int32()), pa.array([*words, "node1"]))
    other = pa.DictionaryArray.from_arrays(pa.array([0, 1], pa.int32()), pa.array(["node2", "step-1"]))
    column = pa.chunked_array([first, same, longer, other])
    joined = JOIN._one_dictionary(column)
    assert joined.to_pylist() == column.to_pylist()
    assert all(chunk.dictionary.equals(joined.chunks[0].dictionary) for chunk in joined.chunks)
    for before, after in zip(column.chunks[:3], joined.chunks[:3]):  # the same index buffers: no copy
        assert after.indices.buffers()[1].address == before.indices.buffers()[1].address
    assert joined.chunks[3].indices.to_pylist() == [5, 1]  # node2 added to the dictionary, step-1 found
