"""ckptfmt.analytics.export_incremental and `ckptfmt analytics export --append`: runs' tables as a
run-partitioned Parquet dataset that grows with them (spec/ANALYTICS.md, "Dataset").

Built from real saves; each export reads only the checkpoints not exported yet (manifest reads are
counted), and the union of a run's parts equals ``tables()`` of the run, after failures and kills too.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch

import ckptfmt
from ckptfmt import analytics
from ckptfmt.analytics import dataset
from ckptfmt.lifecycle.gc import remove
from ckptfmt.repository.repository import Repository

ROOT = Path(__file__).resolve().parents[2]
#: The module that reads the manifests and history objects of the tables.
build_module = importlib.import_module("ckptfmt.analytics.table_build")


def save_checkpoints(repo: Path, first: int, count: int) -> None:
    """``count`` checkpoints of 3 steps each, from checkpoint ``first``; from the fourth on, the steps
    record a metric the earlier ones lack (so later parts have a column earlier ones do not)."""
    model = torch.nn.Linear(4, 2)
    for index in range(first, first + count):
        timer = ckptfmt.StepTimer()
        for step in range(3 * index, 3 * index + 3):
            with timer.step(step):
                timer.batch(torch.arange(4) + step)
                with timer.phase("forward"):
                    model(torch.ones(1, 4))
            timer.metrics(loss=float(step), **({"grad_norm": 1.0} if index >= 3 else {}))
        ckptfmt.save({"model": model.state_dict(), "step": index}, repo / f"step-{index:04d}", step=3 * index + 3,
                     timer=timer)


class Reads:
    """Counts the manifests and history objects the tables read."""

    def __init__(self, monkeypatch):
        self.count = 0
        manifest, histories = Repository.manifest, build_module.read_histories

        def counted_manifest(repo, *args, **kwargs):
            self.count += 1
            return manifest(repo, *args, **kwargs)

        def counted_histories(repo, keys):
            keys = list(keys)
            self.count += len(keys)
            return histories(repo, keys)
        monkeypatch.setattr(Repository, "manifest", counted_manifest)
        monkeypatch.setattr(build_module, "read_histories", counted_histories)

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


def exported(out: Path, table: str, label: str) -> pa.Table | None:
    """The rows of the parts of ``label`` that its state names (what a reader of the dataset reads once
    the export that wrote them is done)."""
    state = json.loads((out / "_state" / f"run={label}.json").read_text())
    parts = [pq.read_table(out / table / f"run={label}" / name) for name in state["parts"].get(table, [])]
    return pa.concat_tables(parts, promote_options="permissive") if parts else None


def rows(table: pa.Table) -> list[str]:
    """The table's rows, each as text with its columns in name order, sorted: what is compared."""
    names = sorted(table.column_names)
    plain = [column.cast(column.type.value_type) if pa.types.is_dictionary(column.type) else column
             for column in (table.column(name) for name in names)]
    return sorted(repr(row) for row in zip(*(column.to_pylist() for column in plain)))


def assert_dataset_is_tables(out: Path, label: str, repo: Path, *, but_removed: int = 0) -> None:
    """Table by table, the run's parts hold what ``tables()`` of the run holds (``environments`` with
    ``run`` added); ``but_removed``: checkpoints removed since they were exported, whose rows stay."""
    built = analytics.tables({label: str(repo)})
    for name, table in built.items():
        parts = exported(out, name, label)
        if parts is None:
            assert table.num_rows == 0, name
            continue
        if name == "environments":
            assert set(parts.column("run").to_pylist()) == {label}
            parts = parts.drop_columns(["run"])
        if but_removed and name in ("checkpoints", "tensors", "environment", "tensor_stats"):
            assert parts.num_rows > table.num_rows, name
            kept = set(built["checkpoints"].column("name").to_pylist())
            parts = parts.filter(pa.compute.is_in(parts.column("name"), pa.array(sorted(kept))))
        assert rows(parts) == rows(table), name


def test_each_export_reads_only_the_new_checkpoints_and_the_dataset_is_the_tables(tmp_path, monkeypatch):
    repo, out = tmp_path / "run", tmp_path / "out"
    reads = Reads(monkeypatch)
    save_checkpoints(repo, 0, 3)
    reads.take()  # what the saves read
    first = analytics.export_incremental({"a": str(repo)}, out)
    assert (reads.take(), first.read, first.skipped) == (3, 3, 0)
    assert first.rows["checkpoints"] == 3 and first.rows["steps"] == 9 and first.rows["environments"] > 0
    assert_dataset_is_tables(out, "a", repo)

    save_checkpoints(repo, 3, 2)
    reads.take()  # what tables() and the saves read
    second = analytics.export_incremental({"a": str(repo)}, out)
    assert (reads.take(), second.read, second.skipped) == (2, 2, 3)
    assert second.rows["steps"] == 6 and second.rows["environments"] == 0  # the same environment: known
    assert sorted(p.name for p in (out / "steps" / "run=a").iterdir()) == ["part-000000.parquet",
                                                                           "part-000001.parquet"]
    assert_dataset_is_tables(out, "a", repo)
    reads.take()  # what tables() read

    third = analytics.export_incremental({"a": str(repo)}, out)
    assert (reads.take(), third.read, third.skipped, sum(third.rows.values())) == (0, 0, 5, 0)
    assert len(list((out / "steps" / "run=a").iterdir())) == 2


def test_environment_ids_are_the_same_in_every_export(tmp_path):
    repo, out = tmp_path / "run", tmp_path / "out"
    save_checkpoints(repo, 0, 1)
    analytics.export_incremental({"a": str(repo)}, out)
    save_checkpoints(repo, 1, 1)
    analytics.export_incremental({"a": str(repo)}, out)
    ids = [pq.read_table(part).column("environment_id").to_pylist()
           for part in sorted((out / "environment" / "run=a").iterdir())]
    assert len(ids) == 2 and ids[0] == ids[1]
    (environments,) = list((out / "environments" / "run=a").iterdir())  # the second export added none
    assert set(pq.read_table(environments).column("environment_id").to_pylist()) == set(ids[0])


def test_removed_checkpoints_keep_their_rows_and_are_not_read_again(tmp_path, monkeypatch):
    """A checkpoint removed after its export: its history object is not read, its rows stay. One removed
    before it was ever exported: its history object is read (its steps, saves and system samples)."""
    repo, out = tmp_path / "run", tmp_path / "out"
    reads = Reads(monkeypatch)
    save_checkpoints(repo, 0, 3)
    analytics.export_incremental({"a": str(repo)}, out)
    save_checkpoints(repo, 3, 2)
    remove(Repository.open(str(repo)), ["step-0001", "step-0003"])
    reads.take()
    appended = analytics.export_incremental({"a": str(repo)}, out)
    # read: step-0003's history object and step-0004; skipped: step-0000, step-0002 and step-0001's history
    assert (reads.take(), appended.read, appended.skipped) == (2, 2, 3)
    assert appended.rows["steps"] == 6 and appended.rows["checkpoints"] == 1
    state = json.loads((out / "_state" / "run=a.json").read_text())
    assert [name for name, _ in state["histories"]] == ["step-0003"]
    assert_dataset_is_tables(out, "a", repo, but_removed=1)
    assert exported(out, "checkpoints", "a").column("name").to_pylist() == [
        "step-0000", "step-0001", "step-0002", "step-0004"]


def test_a_failure_mid_export_leaves_the_previous_state_and_the_next_export_completes_it(tmp_path, monkeypatch):
    repo, out = tmp_path / "run", tmp_path / "out"
    save_checkpoints(repo, 0, 2)
    analytics.export_incremental({"a": str(repo)}, out)
    state = (out / "_state" / "run=a.json").read_bytes()
    save_checkpoints(repo, 2, 2)
    write, written = dataset._write_part, []

    def fail_after_one(path, table):
        if written:
            raise OSError("disk full")
        written.append(path)
        write(path, table)
    monkeypatch.setattr(dataset, "_write_part", fail_after_one)
    with pytest.raises(OSError, match="disk full"):
        analytics.export_incremental({"a": str(repo)}, out)
    assert (out / "_state" / "run=a.json").read_bytes() == state
    assert (out / "checkpoints" / "run=a" / "part-000001.parquet").exists()  # the orphan
    assert exported(out, "checkpoints", "a").num_rows == 2  # what the state names: the previous export

    monkeypatch.setattr(dataset, "_write_part", write)
    appended = analytics.export_incremental({"a": str(repo)}, out)
    assert (appended.read, appended.skipped, appended.rows["checkpoints"]) == (2, 2, 2)
    assert_dataset_is_tables(out, "a", repo)
    assert sorted(p.name for p in (out / "checkpoints" / "run=a").iterdir()) == ["part-000000.parquet",
                                                                                 "part-000001.parquet"]


KILLED = """
import os, signal, sys
from ckptfmt.analytics import dataset
write, written = dataset._write_part, []
def kill_after_two(path, table):
    if len(written) == 2:
        path.with_name("." + path.name + ".tmp").write_bytes(b"half a part")
        os.kill(os.getpid(), signal.SIGKILL)
    written.append(path)
    write(path, table)
dataset._write_part = kill_after_two
dataset.export_incremental({"a": sys.argv[1]}, sys.argv[2])
"""


def test_a_killed_export_is_completed_by_the_next(tmp_path):
    repo, out = tmp_path / "run", tmp_path / "out"
    save_checkpoints(repo, 0, 2)
    analytics.export_incremental({"a": str(repo)}, out)
    save_checkpoints(repo, 2, 1)
    killed = subprocess.run([sys.executable, "-c", KILLED, str(repo), str(out)], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    leftovers = {p.name for p in out.glob("*/run=a/*")} | {p.name for p in out.glob("*/run=a/.*")}
    assert "part-000001.parquet" in leftovers and ".part-000001.parquet.tmp" in leftovers
    assert exported(out, "steps", "a").num_rows == 6  # the state is the first export's

    appended = analytics.export_incremental({"a": str(repo)}, out)
    assert (appended.read, appended.rows["steps"]) == (1, 3)
    assert not list(out.glob("*/run=a/.*"))
    assert_dataset_is_tables(out, "a", repo)


def test_an_export_of_a_run_another_export_holds_is_refused_and_a_killed_ones_lock_taken_over(tmp_path):
    """Two exports of one run at once would each take the other's new parts for a killed export's."""
    repo, out = tmp_path / "run", tmp_path / "out"
    save_checkpoints(repo, 0, 1)
    lock = out / "_state" / "run=a.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))  # a running holder
    with pytest.raises(ckptfmt.CheckpointError, match=f"another export of run 'a' is in progress .process "
                                                       f"{os.getpid()} on"):
        analytics.export_incremental({"a": str(repo)}, out)
    assert lock.exists() and not (out / "_state" / "run=a.json").exists()
    lock.write_text(json.dumps({"pid": os.getpid(), "host": "another-host"}))  # cannot be checked: refused
    with pytest.raises(ckptfmt.CheckpointError, match="in progress .process .* on another-host"):
        analytics.export_incremental({"a": str(repo)}, out)
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, timeout=60)
    lock.write_text(json.dumps({"pid": int(finished.stdout), "host": socket.gethostname()}))  # a killed export's
    assert analytics.export_incremental({"a": str(repo)}, out).read == 1
    assert not lock.exists()  # released when the export ends
    assert_dataset_is_tables(out, "a", repo)


def test_two_runs_in_one_dataset_answer_one_query(tmp_path):
    out = tmp_path / "out"
    save_checkpoints(tmp_path / "runs" / "a", 0, 2)
    save_checkpoints(tmp_path / "runs" / "b", 0, 4)  # its last steps record grad_norm: a column a lacks
    appended = analytics.export_incremental([str(tmp_path / "runs" / "a"), str(tmp_path / "runs" / "b")], out)
    assert (appended.read, appended.rows["steps"]) == (6, 18)
    per_run = duckdb.sql(f"""
        SELECT run, count(*), max(metric_grad_norm) FROM read_parquet('{out}/steps/*/*.parquet',
        hive_partitioning=true, union_by_name=true) GROUP BY run ORDER BY run""").fetchall()
    assert per_run == [("a", 6, None), ("b", 12, 1.0)]
    checkpoints = ds.dataset(out / "checkpoints", partitioning="hive").to_table()
    assert sorted(checkpoints.column("run").to_pylist()) == ["a"] * 2 + ["b"] * 4
    for label in ("a", "b"):
        assert_dataset_is_tables(out, label, tmp_path / "runs" / label)


def test_bad_input_is_refused_with_what_and_where(tmp_path):
    repo, out = tmp_path / "run", tmp_path / "out"
    save_checkpoints(repo, 0, 1)
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ckptfmt.CheckpointError, match="file: the dataset's folder is a file"):
        analytics.export_incremental(str(repo), tmp_path / "file")
    with pytest.raises(ckptfmt.CheckpointError, match="run label 'a/b' is no folder name"):
        analytics.export_incremental({"a/b": str(repo)}, out)
    with pytest.raises(ckptfmt.CheckpointError, match="two runs are labelled 'run'"):
        analytics.export_incremental([str(repo), str(tmp_path / "other" / "run")], out)
    analytics.export_incremental(str(repo), out)
    save_checkpoints(tmp_path / "other" / "run", 0, 1)
    with pytest.raises(ckptfmt.CheckpointError, match="run 'run' of this dataset is .*: give this run another"):
        analytics.export_incremental(str(tmp_path / "other" / "run"), out)
    state = out / "_state" / "run=run.json"
    for damage, message in ((b"{not json", "not JSON"), (b'{"version": 1, "run": "run"}', "damaged"),
                            (state.read_bytes().replace(b'"parts":{', b'"parts":{"x":[],'), "parts is not")):
        state.write_bytes(damage)
        with pytest.raises(dataset.DatasetStateError, match=message) as info:
            analytics.export_incremental(str(repo), out)
        assert str(state) in str(info.value) and isinstance(info.value, ckptfmt.CheckpointError)


def test_the_cli_appends_and_says_what_it_added(tmp_path):
    repo, out = tmp_path / "run", tmp_path / "out"
    save_checkpoints(repo, 0, 2)

    def export(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ckptfmt.cli", "analytics", "export", str(repo), str(out),
                               "--append", *extra], capture_output=True, text=True, timeout=120, cwd=ROOT,
                              env={"COLUMNS": "80", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    first = export("--run", "trial-1")
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert "2 checkpoints read, 0 exported before" in lines[0] and "run trial-1" in lines[0]
    assert any(line.split()[:2] == ["steps", "6"] for line in lines)
    assert all(len(line) <= 80 for line in lines)
    assert (out / "steps" / "run=trial-1" / "part-000000.parquet").exists()
    again = export("--run", "trial-1")
    assert "0 checkpoints read, 2 exported before" in again.stdout.splitlines()[0]
    csv = export("--format", "csv")
    assert csv.returncode == 2 and "--format csv does not go with it" in csv.stderr
