"""``tables`` over shares of checkpoints built in child processes (``ckptfmt.analytics.processes``): the
same tables as one process builds, errors named as one process names them, a failing child in one line."""

from __future__ import annotations

import sys
import threading

import pyarrow as pa
import pytest
import torch

import ckptfmt
from ckptfmt import analytics
from ckptfmt.lifecycle.gc import remove
from ckptfmt.metadata.system import encode_samples
from ckptfmt.repository.repository import Repository
from tests.analytics.test_analytics_tables import train_and_save
from tests.support.helpers import rewrite_manifest

#: The module building the tables (the package binds the name ``tables`` to the function).
TABLES = sys.modules["ckptfmt.analytics.tables"]


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
    real = TABLES.TableProcess

    def counted(*args):
        started.append(real(*args))
        return started[-1]
    monkeypatch.setattr(TABLES, "TableProcess", counted)
    monkeypatch.setattr(TABLES, "SHARE_MIN", 1)
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
    monkeypatch.setattr(TABLES, "WORKER_MODULE", "ckptfmt.analytics.no_such_module")
    with pytest.raises(ckptfmt.CheckpointError, match=r"failed \(exit 1\): .*No module named") as info:
        analytics.tables(repo, processes=2)
    assert "\n" not in str(info.value)


def test_storage_options_a_child_cannot_be_given_build_here(tmp_path, children):
    repo = str(tmp_path / "run")
    train_and_save(repo, checkpoints=2, steps_each=1)
    built = analytics.tables(repo, storage_options={"lock": threading.Lock()}, processes=2)  # no pickle for it
    assert children == [] and built["steps"].num_rows == 2


def test_the_incremental_export_builds_in_children_too(tmp_path, children):
    repo = str(tmp_path / "run")
    train_and_save(repo, checkpoints=3, steps_each=1)
    appended = analytics.export_incremental({"run": repo}, tmp_path / "dataset", processes=2)
    assert len(children) == 1 and appended.read == 3 and appended.rows["steps"] == 3
    ckptfmt.save({"w": torch.ones(2)}, f"{repo}/last", step=9)
    assert analytics.export_incremental({"run": repo}, tmp_path / "dataset", processes=2).read == 1
