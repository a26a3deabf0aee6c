"""Damage that used to go unrepaired or unreported: a damaged or lost repository marker (every read needs
it; repair restores it from another copy), a checkpoint whose commit record was deleted (verify names it,
gc refuses to sweep it), and leases of killed processes (reclaimed by the next gc or save; gc says which
live lease held it back and until when)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt.cli import main
from ckptfmt.errors import CheckpointError, CheckpointNotFoundError, ManifestError
from ckptfmt.format.layout import LEASES_DIR
from ckptfmt.lifecycle.gc import collect
from ckptfmt.lifecycle.repair import repair
from ckptfmt.lifecycle.replicate import replicate
from ckptfmt.repository import leases
from ckptfmt.repository.leases import SAVE, Lease, LeaseLostError
from ckptfmt.repository.repository import Repository
from tests.support.helpers import assert_bits, script_env

STEPS = 5


def state(step: int) -> dict:
    torch.manual_seed(step)
    return {"w": torch.randn(64, 32), "step": step}


@pytest.fixture
def replicated(tmp_path) -> tuple[Path, Path]:
    """A repository of five checkpoints and its replica."""
    repo, replica = tmp_path / "repo", tmp_path / "replica"
    for step in range(STEPS):
        ckptfmt.save(state(step), repo / f"step-{step}", step=step)
    replicate(repo, replica)
    return repo, replica


def assert_every_checkpoint_loads(repo: Path) -> None:
    assert Repository.open(repo).names() == [f"step-{s}" for s in range(STEPS)]
    for step in range(STEPS):
        assert_bits(ckptfmt.load(repo / f"step-{step}")["w"], state(step)["w"])


# -- the marker ---------------------------------------------------------------------------------------


def test_a_damaged_marker_says_repair_fixes_it_and_repair_restores_it_from_the_replica(replicated, capsys):
    repo, replica = replicated
    with open(repo / "ckptfmt.json", "ab") as marker:
        marker.write(b"x")

    with pytest.raises(ManifestError, match=r"marker is damaged .*`ckptfmt repair .* --from REPLICA`"):
        ckptfmt.load(repo / "step-1")
    assert main(["ls", str(repo)]) == 2
    assert "ckptfmt repair" in capsys.readouterr().err

    assert main(["repair", str(repo), "--from", str(replica)]) == 0
    out = capsys.readouterr().out
    assert "ckptfmt.json" in out and "marker" in out and "the repository verifies" in out
    assert (repo / "ckptfmt.json").read_bytes() == (replica / "ckptfmt.json").read_bytes()
    assert_every_checkpoint_loads(repo)


def test_a_lost_marker_is_named_as_such_and_restored(replicated):
    repo, replica = replicated
    (repo / "ckptfmt.json").unlink()

    with pytest.raises(CheckpointNotFoundError, match="lost its marker"):
        Repository.open(repo)
    with pytest.raises(CheckpointNotFoundError, match="lost its marker"):
        ckptfmt.load(repo / "step-2")

    planned = repair(repo, [replica], dry_run=True)
    assert [(f.kind, f.key) for f in planned.fixed] == [("marker", "ckptfmt.json")]
    assert not (repo / "ckptfmt.json").exists()
    report = repair(repo, [replica])
    assert report.ok and report.checkpoints == [f"step-{s}" for s in range(STEPS)]
    assert_every_checkpoint_loads(repo)


def test_a_marker_is_restored_only_from_a_valid_copy(replicated, tmp_path):
    repo, replica = replicated
    (repo / "ckptfmt.json").write_bytes(b"{}")
    broken = tmp_path / "broken"
    replicate(replica, broken)
    (broken / "ckptfmt.json").write_bytes(b'{"format": "ckptfmt-repository"}')  # no version

    with pytest.raises(CheckpointError):  # the only source's marker is no marker either
        Repository.open(broken)
    report = repair(repo, [replica])
    assert report.ok
    with pytest.raises(ManifestError, match="no source holds a valid marker"):
        repair(broken, [])


def test_repair_of_a_folder_that_never_was_a_repository_says_so(tmp_path, replicated):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="not a ckptfmt repository"):
        repair(tmp_path / "empty", [replicated[1]])


# -- a lost commit record ------------------------------------------------------------------------------


def test_verify_names_a_checkpoint_whose_commit_record_is_missing(replicated, capsys):
    repo, replica = replicated
    (repo / "step-2" / "COMMIT").unlink()  # a parent of step-3: surely committed
    (repo / "step-4" / "COMMIT").unlink()  # the newest: only its index entry tells

    assert main(["verify", str(repo), "--json"]) == 1
    problems = {p["checkpoint"]: p for p in json.loads(capsys.readouterr().out)["problems"]}
    assert set(problems) == {"step-2", "step-4"}
    assert all(p["kind"] == "missing-commit" and "ckptfmt repair" in p["message"] for p in problems.values())
    assert "'step-3' names it as its parent" in problems["step-2"]["message"]
    assert "the commit index has an entry for it" in problems["step-4"]["message"]

    assert main(["verify", str(repo)]) == 1
    out = capsys.readouterr().out
    assert "step-2" in out and "missing-commit" in out

    assert repair(repo, [replica]).ok
    assert_every_checkpoint_loads(repo)


def test_verify_names_a_lost_commit_the_index_has_packed(replicated):
    repo, _ = replicated
    Repository.open(repo).rebuild_index()  # every record packed, no entries left
    (repo / "step-4" / "COMMIT").unlink()

    report = ckptfmt.verify(repo)

    assert not report.ok
    assert [(p.kind, p.checkpoint) for p in report.problems] == [("missing-commit", "step-4")]
    assert "the commit index records its commit" in report.problems[0].message


def test_gc_refuses_to_sweep_a_checkpoint_that_lost_its_commit_record(replicated):
    repo, _ = replicated
    (repo / "step-2" / "COMMIT").unlink()
    before = sorted(p for p in repo.rglob("*") if p.is_file())

    with pytest.raises(CheckpointError, match=r"cannot collect garbage: .*step-2/COMMIT: missing"):
        collect(Repository.open(repo))

    assert sorted(p for p in repo.rglob("*") if p.is_file()) == before
    assert main(["rm", str(repo / "step-2")]) == 0  # it was being removed after all: rm finishes the job
    assert not (repo / "step-2").exists()
    assert collect(Repository.open(repo)).swept


def test_a_save_that_failed_at_its_commit_is_not_reported_as_a_lost_commit(tmp_path, monkeypatch):
    """A save whose commit failed (its lease ran out, say) leaves its manifest, with no index entry and
    no commit record: garbage that verify mentions, not damage."""
    repo = tmp_path / "repo"
    ckptfmt.save(state(0), repo / "a", step=0)

    def lose_the_lease(self, record):
        raise LeaseLostError("the lease ran out")
    with monkeypatch.context() as patched:
        patched.setattr(Repository, "create_commit", lose_the_lease)
        with pytest.raises(LeaseLostError):
            ckptfmt.save(state(1), repo / "b", step=1)
    assert list((repo / "b").glob("manifest-*.msgpack"))

    report = ckptfmt.verify(repo)
    assert report.ok and any(w.endswith(": b") for w in report.warnings), report.warnings


# -- leases --------------------------------------------------------------------------------------------

HOLDER = """
import sys, time
from ckptfmt.repository.leases import Lease, SAVE
from ckptfmt.repository.repository import Repository
Lease(Repository.open(sys.argv[1]), SAVE, ttl_s=float(sys.argv[2])).acquire()
print("held", flush=True)
time.sleep(600)
"""


def hold_then_kill(repo: Path, ttl_s: float) -> None:
    """A process that takes a save lease and is killed with it (no release)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(repo), str(ttl_s)], stdout=subprocess.PIPE,
                              text=True, env=script_env())
    try:
        assert holder.stdout.readline().strip() == "held"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        holder.stdout.close()


def lease_files(repo: Path) -> list[str]:
    return sorted(p.name for p in (repo / LEASES_DIR).glob("*.json"))


def test_the_leases_of_killed_processes_are_reclaimed_by_the_next_gc(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    ckptfmt.save(state(0), repo / "a", step=0)
    monkeypatch.setattr(leases, "CLOCK_SKEW_S", 0.2)
    for _ in range(3):
        hold_then_kill(repo, ttl_s=0.3)
    assert len(lease_files(repo)) == 3
    time.sleep(0.6)

    report = collect(Repository.open(repo))

    assert report.swept and lease_files(repo) == []


def test_the_next_save_reclaims_expired_leases(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    ckptfmt.save(state(0), repo / "a", step=0)
    monkeypatch.setattr(leases, "CLOCK_SKEW_S", 0.2)
    hold_then_kill(repo, ttl_s=0.3)
    time.sleep(0.6)

    ckptfmt.save(state(1), repo / "b", step=1)

    assert lease_files(repo) == []


def test_gc_names_the_live_lease_that_held_it_back_and_until_when(tmp_path, capsys):
    repo = tmp_path / "repo"
    ckptfmt.save(state(0), repo / "a", step=0)
    hold_then_kill(repo, ttl_s=60)
    (lease,) = (repo / LEASES_DIR).glob("*.json")  # its holder is on another machine: live for 60 s plus the skew
    record = json.loads(lease.read_text())
    lease.write_text(json.dumps({**record, "process": {**record["process"], "boot": "another machine's"}}))

    assert main(["gc", str(repo), "--wait", "1s"]) == 1

    out = capsys.readouterr().out.replace("\n", " ")
    holder = re.search(r"held by (\S+):(\d+) until (\d\d:\d\d:\d\d) UTC \(in (\d+) s\)", out)
    assert holder, out
    assert 60 <= int(holder[4]) <= 90 and "live save lease" in out and holder[2].isdigit()
    assert len(lease_files(repo)) == 1  # live: not reclaimed


def test_a_lease_that_lapsed_is_never_renewed(tmp_path, monkeypatch):
    """A holder paused past its lease's expiry must not write it again: another process may have reclaimed
    it (and a collector swept) meanwhile."""
    repo = Repository.open(tmp_path / "repo", create=True)
    lease = Lease(repo, SAVE, ttl_s=0.4).acquire()
    key = lease.key
    lease._valid_until_ns = time.time_ns() - 1  # as if the process had been paused past the expiry
    written = repo.storage.read(key, max_size=4096)
    time.sleep(0.3)  # a renewal was due (every ttl / 4)

    assert repo.storage.read(key, max_size=4096) == written
    with pytest.raises(LeaseLostError, match="expired before it could be renewed"):
        lease.check("committing")
    lease.release()
