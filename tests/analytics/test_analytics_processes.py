"""``tables`` over shares of checkpoints built in child processes (``ckptfmt.analytics.processes``): the
same tables as one process builds, errors named as one process names them, a failing child in one line."""

from __future__ import annotations

import importlib
import os
import sys
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ckptfmt
from ckptfmt import analytics
from ckptfmt.lifecycle.gc import remove
from ckptfmt.metadata.system import encode_samples
from ckptfmt.repository.repository import Repository
from tests.analytics.test_analytics_tables import train_and_save
from tests.support.helpers import rewrite_manifest

#: The module building the tables and starting the children (``ckptfmt.analytics.tables`` re-exports its names).
BUILD = importlib.import_module("ckptfmt.analytics.table_build")


def later_checkpoints_differ(repo: str) -> None:
    """The run's later checkpoints meet what the earlier ones never did: a phase and a metric, system
    samples and another environment; and an early checkpoint is removed (its history object stays)."""
    storage = Repository.open(repo).storage
    names = [record.name for record in Repository.open(repo).commits()]

    def new_things(doc):
        rank = doc["timing"]["ranks"][0]
        count = rank["steps"]["count"]
        rank["steps"]["phases"]["optimizer"] = b"\0" * 8 * count
        rank["steps"]["metrics"] = {**rank["steps"].get("metrics", {}), "lr": b"\0" * 8 * count}
        rank["system"] = encode_samples([1, 2], [{"load_1m": 1.0}, {"load_1m": 2.0, "cpu_count": 2.0}], 1.0)
        doc["environment"]["python"] = {**doc["environment"].get("python", {}), "version": "3.99"}

    for name in names[-2:]:
        rewrite_manifest(storage, name, new_things)
    remove(Repository.open(repo), [names[1]])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("shares")
    train_and_save(str(root / "a"), checkpoints=6, steps_each=2)
    later_checkpoints_differ(str(root / "a"))
    train_and_save(str(root / "b"), checkpoints=2, steps_each=2)
    return {"a": str(root / "a"), "b": str(root / "b")}


def plain(table: pa.Table) -> list[dict]:
    """A table's rows, text columns as plain strings (each share has its own dictionaries)."""
    return pa.table({name: column.cast(pa.string()) if pa.types.is_dictionary(column.type) else column
                     for name, column in zip(table.column_names, table.columns)}).to_pylist()


@pytest.fixture
def children(monkeypatch) -> list:
    """The children started, and shares of one checkpoint allowed."""
    started = []
    real = BUILD.TableProcess

    def counted(*args):
        started.append(real(*args))
        return started[-1]
    monkeypatch.setattr(BUILD, "TableProcess", counted)
    monkeypatch.setattr(BUILD, "SHARE_MIN", 1)
    return started


@pytest.mark.parametrize("processes", [2, 3])
def test_shares_built_in_children_give_the_tables_of_one_process(runs, children, processes):
    alone = analytics.tables(runs, processes=1)
    assert children == []
    shared = analytics.tables(runs, processes=processes)
    assert len(children) == processes - 1
    assert alone["steps"].column_names[-2:] == ["phase_backward", "phase_optimizer"]  # met last: in a child's share
    assert {"metric_lr", "load_1m", "cpu_count"} <= set(alone["steps"].column_names) | set(
        alone["system"].column_names)
    assert len(set(alone["environment"]["environment_id"].to_pylist())) == 2
    for name, table in alone.items():
        assert shared[name].schema == table.schema, name
        assert plain(shared[name]) == plain(table), name
        for column in shared[name].columns:  # one dictionary per text column, as one process gives
            if pa.types.is_dictionary(column.type):
                assert all(chunk.dictionary.equals(column.chunks[0].dictionary) for chunk in column.chunks), name


def test_a_damaged_manifest_in_a_childs_share_is_named_as_one_process_names_it(tmp_path, children):
    repo = str(tmp_path / "run")
    train_and_save(repo, checkpoints=4, steps_each=2)
    rewrite_manifest(Repository.open(repo).storage, "step-0008", lambda doc: doc["timing"]["ranks"][0].update(
        rank="zero"))
    said = []
    for processes in (1, 2):
        with pytest.raises(ckptfmt.ManifestError) as info:
            analytics.tables(repo, processes=processes)
        said.append(str(info.value))
    assert len(children) == 1 and said[0] == said[1] and "step-0008" in said[0]


def test_a_child_that_cannot_run_is_named_in_one_line(tmp_path, children, monkeypatch):
    repo = str(tmp_path / "run")
    train_and_save(repo, checkpoints=2, steps_each=1)
    monkeypatch.setattr(BUILD, "WORKER_MODULE", "ckptfmt.analytics.no_such_module")
    with pytest.raises(ckptfmt.CheckpointError, match=r"failed \(exit 1: .*No module named") as info:
        analytics.tables(repo, processes=2)
    assert "\n" not in str(info.value)
    monkeypatch.setattr(BUILD, "WORKER_MODULE", "tests.support.dying_table_worker")
    with pytest.raises(ckptfmt.CheckpointError, match=r"failed \(killed by SIGKILL\)$"):
        analytics.tables(repo, processes=2)


def test_storage_options_a_child_cannot_be_given_build_here(tmp_path, children):
    repo = str(tmp_path / "run")
    train_and_save(repo, checkpoints=2, steps_each=1)
    built = analytics.tables(repo, storage_options={"lock": threading.Lock()}, processes=2)  # no pickle for it
    assert children == [] and built["steps"].num_rows == 2


def test_the_incremental_export_builds_in_children_too(runs, tmp_path, children):
    alone = analytics.export_incremental(runs, tmp_path / "alone", processes=1)
    assert children == []
    shared = analytics.export_incremental(runs, tmp_path / "shared", processes=2)
    assert len(children) == 2 and shared == alone  # a child for each run's share
    for name in ("steps", "system", "environments"):
        parts = [sorted((folder / name).glob("run=*/*.parquet"))
                 for folder in (tmp_path / "alone", tmp_path / "shared")]
        assert [p.relative_to(tmp_path / "alone") for p in parts[0]] == [
            p.relative_to(tmp_path / "shared") for p in parts[1]] != []
        for one, other in zip(*parts):
            assert plain(pq.ParquetFile(one).read()) == plain(pq.ParquetFile(other).read()), one


def test_a_run_in_this_process_memory_is_built_here(children):
    url = "memory://shares-in-memory/run"
    train_and_save(url, checkpoints=3, steps_each=1)
    assert plain(analytics.tables(url, processes=2)["steps"]) == plain(analytics.tables(url, processes=1)["steps"])
    assert children == []


def test_a_childs_warnings_are_raised_here(tmp_path, children):
    """A damaged history object in a child's share: skipped with the warning one process gives."""
    repo = tmp_path / "run"
    train_and_save(str(repo), checkpoints=4, steps_each=1)
    remove(Repository.open(str(repo)), ["step-0003"])
    [history] = (repo / "_history").iterdir()
    history.write_bytes(b"not msgpack")
    for processes in (1, 2):
        with pytest.warns(ckptfmt.CheckpointWarning, match="skipping a history object"):
            built = analytics.tables(str(repo), processes=processes)
        assert built["saves"]["name"].to_pylist().count("step-0003") == 0
    assert len(children) == 1


def _only_in(pid: int) -> object:
    """Rebuilds a storage option in process ``pid`` only (as a class of a caller's ``__main__`` does)."""
    if os.getpid() != pid:
        raise RuntimeError("this object is rebuilt only where it was made")
    return "unused"


class CallerOnly:
    def __reduce__(self):
        return _only_in, (os.getpid(),)


def test_a_share_a_child_cannot_load_or_no_child_can_start_is_built_here(runs, children, monkeypatch):
    alone = plain(analytics.tables(runs, processes=1)["steps"])
    assert plain(analytics.tables(runs, storage_options={"x": CallerOnly()}, processes=2)["steps"]) == alone
    assert len(children) == 1 and children[0].process.returncode == 0
    monkeypatch.setattr(sys, "executable", "/no/such/python")
    assert plain(analytics.tables(runs, processes=3)["steps"]) == alone
