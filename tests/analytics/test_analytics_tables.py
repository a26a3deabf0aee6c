"""ckptfmt.analytics.tables and `ckptfmt analytics export`: a run's metadata as Arrow tables (spec/ANALYTICS.md).

Built from real saves (one process on every backend, 2 gloo ranks), queried
through the exported Parquet files with DuckDB.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.csv as pa_csv
import pytest
import torch

import ckptfmt
from ckptfmt import analytics
from ckptfmt.analytics.tables import environment_id
from ckptfmt.format.manifest import FORMAT_VERSION
from ckptfmt.lifecycle.gc import remove
from ckptfmt.repository.repository import Repository
from tests.support.helpers import rewrite_manifest
from tests.support.ranks import run_ranks


def train_and_save(repo: str, *, checkpoints: int = 3, steps_each: int = 4, rank: int = 0) -> list[str]:
    """A tiny loop: each step has data/forward phases (plus `backward` from step 2), a batch and a loss."""
    torch.manual_seed(0)
    timer = ckptfmt.StepTimer()
    model = torch.nn.Linear(8, 4)
    urls = []
    step = 0
    for index in range(checkpoints):
        for _ in range(steps_each):
            with timer.step(step):
                timer.batch(torch.arange(4) + 4 * step + 1000 * rank)
                with timer.phase("data"):
                    pass
                with timer.phase("forward"):
                    loss = model(torch.randn(2, 8)).sum()
                if step >= 2:
                    with timer.phase("backward"):
                        loss.backward()
            timer.metrics(loss=float(step))
            step += 1
        urls.append(ckptfmt.save({"model": model.state_dict(), "step": step}, f"{repo}/step-{step:04d}",
                                 step=step, timer=timer, compression="zstd" if index == 1 else None))
    return urls


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> tuple[str, dict]:
    repo = str(tmp_path_factory.mktemp("analytics") / "run")
    train_and_save(repo)
    return repo, analytics.tables(repo)


def test_every_table_is_built_with_its_documented_columns(local_run):
    _, built = local_run
    assert list(built) == list(analytics.TABLE_NAMES)
    assert built["checkpoints"].column_names[:4] == ["run", "name", "step", "created"]
    assert {"run", "checkpoint", "rank", "step", "start", "duration_s", "batch", "batch_size", "phase_data",
            "phase_forward", "phase_backward", "metric_loss"} <= set(built["steps"].column_names)
    assert built["steps"].schema.field("start").type == pa.timestamp("us", tz="UTC")
    assert built["steps"].schema.field("batch").type == pa.binary(16)


def test_checkpoints_and_steps_hold_what_the_run_recorded(local_run):
    repo, built = local_run
    checkpoints = built["checkpoints"].to_pylist()
    assert [c["name"] for c in checkpoints] == ["step-0004", "step-0008", "step-0012"]
    assert [c["step"] for c in checkpoints] == [4, 8, 12]
    version = "{}.{}".format(*FORMAT_VERSION)
    assert all(c["world_size"] == 1 and c["save_s"] > 0 and c["format_version"] == version for c in checkpoints)
    assert checkpoints[0]["new_bytes"] == checkpoints[0]["stored_bytes"] > 0
    steps = built["steps"].to_pylist()
    assert [s["step"] for s in steps] == list(range(12))
    assert [s["checkpoint"] for s in steps] == ["step-0004"] * 4 + ["step-0008"] * 4 + ["step-0012"] * 4
    assert [s["metric_loss"] for s in steps] == [float(i) for i in range(12)]
    assert steps[0]["phase_backward"] is None and steps[2]["phase_backward"] > 0  # a phase met at step 2
    assert len({s["batch"] for s in steps}) == 12 and {s["batch_size"] for s in steps} == {4}
    phases = {row["phase"] for row in built["saves"].to_pylist()}
    assert {"prepare", "write_chunks", "sync"} <= phases


def test_tensors_list_their_chunks_and_environment_is_flattened(local_run):
    repo, built = local_run
    tensors = built["tensors"].to_pylist()
    weight = [t for t in tensors if t["key"] == "model/weight"]
    assert len(weight) == 3 and weight[0]["shape"] == [4, 8] and weight[0]["dtype"] == "float32"
    assert all(len(t["chunks"]) == 1 and len(t["chunks"][0]) == 64 for t in weight)
    # the three checkpoints ran in one environment: stored once, each checkpoint's rank referring to it
    environment = built["environment"].to_pylist()
    assert [(row["name"], row["rank"]) for row in environment] == [(n, 0) for n in ("step-0004", "step-0008",
                                                                                     "step-0012")]
    (identity,) = {row["environment_id"] for row in environment}
    fields = {row["field"]: row["value"] for row in built["environments"].to_pylist()}
    assert set(built["environments"].column("environment_id").to_pylist()) == {identity}
    # the id is the environment's, not the call's: another call, and the environment's own fields, give it
    assert analytics.tables(repo)["environment"].column("environment_id").to_pylist() == [identity] * 3
    assert environment_id(sorted(fields.items())) == identity
    assert fields["torch.version"] == torch.__version__
    assert {"python.version", "determinism.deterministic_algorithms", "packages.torch"} <= set(fields)


def test_exported_parquet_answers_sql(local_run, tmp_path):
    repo, built = local_run
    analytics.export(built, tmp_path / "out")
    out = tmp_path / "out"
    slowest = duckdb.sql(f"""
        SELECT checkpoint, count(*) AS steps, sum(phase_backward IS NOT NULL) AS with_backward, max(metric_loss)
        FROM '{out}/steps.parquet' GROUP BY checkpoint ORDER BY checkpoint""").fetchall()
    assert slowest == [("step-0004", 4, 2, 3.0), ("step-0008", 4, 4, 7.0), ("step-0012", 4, 4, 11.0)]
    joined = duckdb.sql(f"""
        SELECT c.step, sum(t.nbytes) FROM '{out}/checkpoints.parquet' c JOIN '{out}/tensors.parquet' t
        ON c.name = t.name GROUP BY c.step ORDER BY c.step""").fetchall()
    assert joined == [(4, 144), (8, 144), (12, 144)]  # weight 4x8 and bias 4, fp32
    torch_rows = duckdb.sql(f"""
        SELECT e.name, f.value FROM '{out}/environment.parquet' e JOIN '{out}/environments.parquet' f
        USING (environment_id) WHERE f.field = 'torch.version' ORDER BY e.name""")
    assert torch_rows.fetchall() == [(name, torch.__version__) for name in ("step-0004", "step-0008", "step-0012")]


def test_the_cli_exports_csv(local_run, tmp_path):
    repo, _ = local_run
    result = subprocess.run([sys.executable, "-m", "ckptfmt.cli", "analytics", "export", repo, str(tmp_path / "csv"),
                             "--format", "csv"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "steps" in result.stdout
    steps = pa_csv.read_csv(tmp_path / "csv" / "steps.csv")
    assert steps.num_rows == 12 and len(steps.column("batch")[0].as_py()) == 32  # 16 bytes as hex
    tensors = pa_csv.read_csv(tmp_path / "csv" / "tensors.csv")
    assert tensors.column("shape")[0].as_py() in ("[4, 8]", "[4]")


def test_tables_of_a_repository_on_s3(s3_bucket):
    repo = f"{s3_bucket}/run"
    train_and_save(repo, checkpoints=2, steps_each=2)
    built = analytics.tables({"on-s3": repo})
    assert built["checkpoints"].column("run").to_pylist() == ["on-s3", "on-s3"]
    assert built["steps"].num_rows == 4


def test_several_runs_concatenate_by_label(local_run, tmp_path):
    repo, _ = local_run
    other = str(tmp_path / "other")
    train_and_save(other, checkpoints=1)
    built = analytics.tables({"a": repo, "b": other})
    runs = built["steps"].column("run").to_pylist()
    assert runs.count("a") == 12 and runs.count("b") == 4


@pytest.mark.parametrize(("change", "message"), [
    (lambda ranks: ranks[0]["steps"].update(duration_s="fast"), "duration_s is not 2 float64 values"),
    (lambda ranks: ranks[0]["steps"].update(count=3), "step is not 3 int64 values"),
    (lambda ranks: ranks[0]["steps"]["phases"].update(data={"a": 1}), "phases.data is not 2 float64"),
    (lambda ranks: ranks[0].update(rank="zero"), r"timing.ranks\[0\].rank is not an int"),
    (lambda ranks: ranks[0].update(phases=7), "not an array"),
    (lambda ranks: ranks[0]["phases"][0].update(duration_s="slow"), "duration_s holds 'slow'"),
])
def test_a_manifest_with_wrongly_typed_records_names_its_checkpoint(tmp_path, change, message):
    repo = str(tmp_path / "run")
    train_and_save(repo, checkpoints=2, steps_each=2)
    storage = Repository.open(repo).storage
    rewrite_manifest(storage, "step-0004", lambda doc: change(doc["timing"]["ranks"]))
    with pytest.raises(ckptfmt.ManifestError, match=message) as info:
        analytics.tables(repo)
    assert "step-0004" in str(info.value)


# -- two ranks -----------------------------------------------------------------------------------
def train_on_ranks(rank: int, world: int, folder: Path, repo: str) -> list[str]:
    return train_and_save(repo, checkpoints=2, steps_each=3, rank=rank)


@pytest.mark.distributed
def test_every_rank_has_its_steps_and_environment(tmp_path):
    repo = str(tmp_path / "run")
    [o.unwrap() for o in run_ranks(train_on_ranks, 2, tmp_path / "ranks", repo=repo)]
    built = analytics.tables(repo)
    steps = built["steps"].to_pylist()
    assert sorted((s["rank"], s["step"]) for s in steps) == [(r, s) for r in (0, 1) for s in range(6)]
    digests = {(s["rank"], s["step"]): s["batch"] for s in steps}
    assert digests[(0, 0)] != digests[(1, 0)]  # each rank's own samples
    ranks = {(row["name"], row["rank"]) for row in built["environment"].to_pylist()}
    assert ranks == {(name, rank) for name in ("step-0003", "step-0006") for rank in (0, 1)}
    assert set(built["saves"].column("rank").to_pylist()) == {0, 1}
    assert built["checkpoints"].column("world_size").to_pylist() == [2, 2]


def test_without_pyarrow_the_cli_names_the_extra(local_run, tmp_path):
    repo, _ = local_run
    probe = ("import sys; sys.modules['pyarrow'] = None\n"
             "from ckptfmt.cli import main\n"
             f"sys.exit(main(['analytics', 'export', {repo!r}, {str(tmp_path / 'out')!r}]))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "pip install 'ckptfmt[analytics]'" in result.stderr


# -- manifests read without their RNG states (what the tables do) --------------------------------
def test_a_manifest_read_skipping_rng_equals_the_full_read_but_rng(local_run):
    repo, _ = local_run
    repository = Repository.open(repo)
    name = repository.names()[0]
    full, skimmed = repository.manifest(name), repository.manifest(name, skip=frozenset({"rng"}))
    assert full.rng and skimmed.rng == []
    assert dataclasses.replace(skimmed, rng=full.rng) == full


@pytest.mark.parametrize(("patch", "message"), [
    (lambda data: data + b"\xc0", "extra data"),
    (lambda data: b"\x92\x01\x02", "manifest is not a map"),
])
def test_skipping_keeps_the_checks_of_the_full_read(local_run, patch, message):
    from ckptfmt.format.manifest import Manifest

    repo, _ = local_run
    repository = Repository.open(repo)
    name = repository.names()[0]
    data = patch(repository.manifest(name).to_bytes())
    for skip in (frozenset(), frozenset({"rng"})):
        with pytest.raises(ckptfmt.ManifestError, match=message):
            Manifest.from_bytes(data, "here", skip=skip)


def test_a_top_level_key_twice_is_refused_when_skipping_too():
    import msgpack

    from ckptfmt.format.manifest import Manifest

    body = msgpack.packb({"rng": []}, use_bin_type=True)
    data = b"\x82" + body[1:] + body[1:]  # a map of two entries, both "rng"
    for skip in (frozenset(), frozenset({"rng"})):
        with pytest.raises(ckptfmt.ManifestError, match="'rng' twice"):
            Manifest.from_bytes(data, "here", skip=skip)
    with pytest.raises(ValueError, match="only optional fields"):
        Manifest.from_bytes(data, "here", skip=frozenset({"tensors"}))


def test_a_run_without_step_records_or_checkpoints_gives_empty_tables(tmp_path):
    repo = tmp_path / "run"
    empty = analytics.tables(str(Repository.open(repo, create=True).url))
    assert all(table.num_rows == 0 for table in empty.values())
    ckptfmt.save({"w": torch.ones(3)}, repo / "a", step=1)  # no timer
    built = analytics.tables(str(repo))
    assert built["checkpoints"].num_rows == 1 and built["steps"].num_rows == 0
    assert built["steps"].column_names[:4] == ["run", "checkpoint", "rank", "host"]


def test_resumes_hold_each_part_a_resume_compared_even_once_its_checkpoint_is_removed(tmp_path):
    """A resume whose optimizer state was dropped: one row per part, the dropped one `missing` with its
    keys; the checkpoint that stored the record is removed and the row stays (its history object)."""
    repo = tmp_path / "run"
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    ckptfmt.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, repo / "step-1", step=1)
    state = ckptfmt.load(str(repo / "step-1"))
    model.load_state_dict(state["model"])  # the optimizer's state is never loaded
    ckptfmt.record_resume(str(repo / "step-1"), {"model": model, "optimizer": torch.optim.AdamW(model.parameters())})
    ckptfmt.save({"model": model.state_dict()}, repo / "step-2", step=2)
    ckptfmt.save({"model": model.state_dict()}, repo / "step-3", step=3)
    remove(Repository.open(str(repo)), ["step-2"])
    rows = analytics.tables(str(repo))["resumes"].to_pylist()
    assert [(row["checkpoint"], row["from_name"], row["from_step"], row["part"], row["verdict"]) for row in rows] == [
        ("step-2", "step-1", 1, "model", "equal"), ("step-2", "step-1", 1, "optimizer", "missing")]
    assert rows[1]["missing"] > 0 and rows[1]["keys"][0].startswith("optimizer/state/")
    assert (rows[0]["world_size_then"], rows[0]["world_size_now"], rows[0]["rank"]) == (1, 1, 0)


def test_the_tensor_stats_builder_is_tensor_stats_table_and_its_old_name_warns():
    """Issue 50: ``TensorStats`` also named the TUI's statistics of a tensor's values; the builder of the
    ``tensor_stats`` table is ``TensorStatsTable``, its old name importable with a DeprecationWarning."""
    from ckptfmt.analytics.table_rows import TensorStatsTable

    with pytest.warns(DeprecationWarning, match="TensorStats is renamed TensorStatsTable"):
        from ckptfmt.analytics.tables import TensorStats
    assert TensorStats is TensorStatsTable
    with pytest.raises(ImportError):
        from ckptfmt.analytics.tables import NoSuchBuilder  # noqa: F401
