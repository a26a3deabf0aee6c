"""Every Python example in README.md and docs/ runs as written.

Each ```python block runs in a fresh folder in its own interpreter, with the
test S3 server standing in for ``s3://bucket``. A block preceded by
``<!-- example: torchrun N -->`` runs on N gloo ranks under torchrun. The
CheckpointManager example is also killed mid-run and resumed by running it
again, as a user would: it must finish, and bit-identically to a run that was
never killed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import ckptfmt
from tests.support import markers

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"(?:<!-- example: (?P<how>[^>]*?) -->\n)?```python\n(?P<code>.*?)^```", re.S | re.M)
TIMEOUT_S = 240


@dataclass
class Example:
    where: str
    code: str
    ranks: int | None  # None: one plain process

    def __str__(self) -> str:
        return self.where


def examples() -> list[Example]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            how = match["how"]
            ranks = None
            if how is not None:
                launcher = re.fullmatch(r"torchrun (\d+)", how)
                assert launcher, f"{path.name}: unknown example marker {how!r}"
                ranks = int(launcher[1])
            line = text.count("\n", 0, match.start("code")) + 1
            found.append(Example(f"{path.relative_to(ROOT)}:{line}", match["code"], ranks))
    return found


class Bucket:
    """The ``s3://bucket`` of the examples."""

    def __init__(self, client):
        self.client = client
        client.create_bucket(Bucket="bucket")

    def empty(self) -> None:
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket="bucket"):
            for item in page.get("Contents", []):
                self.client.delete_object(Bucket="bucket", Key=item["Key"])


@pytest.fixture
def bucket(s3_server, s3_client):
    bucket = Bucket(s3_client)
    yield bucket
    bucket.empty()
    s3_client.delete_bucket(Bucket="bucket")


def run_example(example: Example, folder: Path, *, runner: str | None = None) -> subprocess.CompletedProcess:
    """Run the example's code in ``folder`` (through ``runner``, a script that runs example.py, if given)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "example.py").write_text(example.code)
    script = "example.py" if runner is None else runner
    if example.ranks is None:
        command = [sys.executable, script]
    else:
        markers.require("distributed")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={example.ranks}", script]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def test_the_readme_has_examples():
    assert len(examples()) >= 4, [str(e) for e in examples()]


def manager_example() -> Example:
    """The docs' CheckpointManager loop in one process (docs/lifecycle.md; its multi-node script, under
    torchrun, runs as the other examples do)."""
    (found,) = [e for e in examples() if "CheckpointManager(" in e.code and "restore(" in e.code and e.ranks is None]
    return found


@pytest.mark.parametrize("example", [pytest.param(e, marks=[pytest.mark.distributed] if e.ranks else [])
                                     for e in examples() if e.code != manager_example().code], ids=str)
def test_example_runs_as_written(example, bucket, tmp_path):
    """Every example but the manager's, which ``uninterrupted`` runs as written."""
    result = run_example(example, tmp_path)
    assert result.returncode == 0, f"{example} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-6000:]
    # A warning from ckptfmt means the example does something wrong (load(into=) that lost per-rank values
    # warned and exited 0): as written, no example may draw one.
    assert "CheckpointWarning" not in result.stderr, result.stderr[-6000:]


# -- the CheckpointManager loop: fresh start, kill, resume -----------------------------------------------
KILL_AFTER_SAVING = """
import os, runpy, signal
import ckptfmt

KILL_AT = {kill_at}
save = ckptfmt.CheckpointManager.save


def save_then_die(self, step, *args, **kwargs):
    saved = save(self, step, *args, **kwargs)
    if step == KILL_AT:  # the async save of this step may still be in flight: killed with it
        os.kill(os.getpid(), signal.SIGKILL)
    return saved


ckptfmt.CheckpointManager.save = save_then_die
runpy.run_path("example.py", run_name="__main__")
"""


def final_model(folder: Path) -> tuple[dict, int]:
    repo = ckptfmt.Repository.open(str(folder / "runs" / "exp1"))
    newest = repo.latest_record()
    return ckptfmt.load(f"{repo.url}/{newest.name}", mmap=False)["model"], newest.step


@pytest.fixture(scope="module")
def uninterrupted(s3_server, tmp_path_factory) -> tuple[dict, int]:
    """The manager example's newest checkpoint (its model, its step) when nothing kills it."""
    import boto3

    bucket = Bucket(boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1"))
    folder = tmp_path_factory.mktemp("uninterrupted")
    result = run_example(manager_example(), folder)
    bucket.empty()
    bucket.client.delete_bucket(Bucket="bucket")
    assert result.returncode == 0, result.stderr[-6000:]
    assert "Traceback" not in result.stderr, result.stderr[-6000:]
    return final_model(folder)


def test_the_manager_example_runs_as_written(uninterrupted):
    assert uninterrupted[1] == 90


@pytest.mark.exhaustive  # 2 x 30 s: make test runs the example once as written
@pytest.mark.parametrize("kill_at", [0, 45])
def test_the_manager_example_resumes_after_a_kill(uninterrupted, bucket, tmp_path, kill_at):
    example = manager_example()
    expected, expected_step = uninterrupted
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "kill.py").write_text(KILL_AFTER_SAVING.format(kill_at=kill_at))
    first = run_example(example, killed, runner="kill.py")
    assert first.returncode == -9, first.stderr[-3000:]
    # The same script, run again as it is, resumes from what the killed run committed.
    steps_before = ckptfmt.CheckpointManager(str(killed / "runs" / "exp1")).steps()
    assert max(steps_before, default=-1) <= kill_at, steps_before
    second = run_example(example, killed)
    assert second.returncode == 0, second.stderr[-6000:]

    got, got_step = final_model(killed)
    assert got_step == expected_step == 90
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def test_restore_on_a_fresh_start_returns_none_and_starts_at_zero(tmp_path):
    manager = ckptfmt.CheckpointManager(str(tmp_path / "repo"))
    assert manager.restore() is None and manager.start_step == 0
    manager.save(7, {"w": torch.ones(3)})
    manager.wait()
    assert ckptfmt.CheckpointManager(str(tmp_path / "repo")).restore() is not None
    resumed = ckptfmt.CheckpointManager(str(tmp_path / "repo"))
    resumed.restore()
    assert resumed.start_step == 8
    with pytest.raises(ckptfmt.CheckpointNotFoundError, match="step 3"):
        resumed.restore(step=3)  # a step asked for by name must exist
