"""Destructive operations stay inside their repository: nothing that deletes or overwrites (rm, gc and
retention, repair, sync's destination, the Lightning plug-in's removals) acts through a symbolic link, and
'..' segments are refused in checkpoint and repository URLs rather than resolved away."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt.cli import main
from ckptfmt.errors import InvalidNameError, UnsafePathError
from ckptfmt.lifecycle.gc import collect
from ckptfmt.lifecycle.repair import repair
from ckptfmt.lifecycle.replicate import replicate
from ckptfmt.repository.repository import Repository


def tree(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder`` with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def other(tmp_path) -> Path:
    """Another repository with one checkpoint (named as the link to it will be) and a user's file in its folder."""
    repo = tmp_path / "other"
    ckptfmt.save({"w": torch.arange(6.0)}, repo / "victim", step=1)
    (repo / "victim" / "notes.txt").write_text("the user's own notes")
    return repo


@pytest.fixture
def repo(tmp_path) -> Path:
    repo = tmp_path / "repo"
    ckptfmt.save({"w": torch.ones(3)}, repo / "a", step=1)
    return repo


def test_rm_of_a_link_to_another_repositorys_checkpoint_is_refused_naming_the_link(repo, other, capsys):
    (repo / "victim").symlink_to(other / "victim")
    before = tree(other)

    code = main(["rm", str(repo / "victim")])

    err = capsys.readouterr().err
    assert code == 2
    assert "symbolic link" in err and str(repo / "victim") in err.replace("\n", "")
    assert tree(other) == before
    report = ckptfmt.verify(other)
    assert report.ok and report.checkpoints == ["victim"]


def test_rm_refuses_before_deleting_any_of_the_named_checkpoints(repo, other):
    (repo / "victim").symlink_to(other / "victim")
    with pytest.raises(UnsafePathError):
        ckptfmt.lifecycle.gc.remove(Repository.open(repo), ["a", "victim"])
    assert (repo / "a" / "COMMIT").exists()


def test_retention_does_not_delete_through_a_link(other, repo, capsys):
    (repo / "victim").symlink_to(other / "victim")  # saved before "a": the oldest, the one keep-last drops
    before = tree(other)

    code = main(["gc", str(repo), "--keep-last", "1"])

    assert code == 2 and "symbolic link" in capsys.readouterr().err
    assert tree(other) == before


def test_gc_does_not_sweep_through_a_linked_chunk_folder(repo, other):
    ours = Repository.open(repo)
    shard = next(p for p in (repo / "chunks").iterdir() if p.is_dir())
    foreign = other / "chunks" / shard.name
    foreign.mkdir(exist_ok=True)
    for entry in shard.iterdir():
        os.replace(entry, foreign / entry.name)
    shard.rmdir()
    shard.symlink_to(foreign)
    ckptfmt.lifecycle.gc.remove(ours, ["a"])  # its chunk, behind the link, is now garbage
    before = tree(other)

    collect(ours)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        ours.storage.delete_many([f"chunks/{shard.name}/{entry}" for entry in os.listdir(foreign)])

    assert tree(other) == before


def test_repair_does_not_write_through_a_link(repo, other, tmp_path):
    replica = tmp_path / "replica"
    replicate(repo, replica)
    (repo / "a" / "COMMIT").unlink()
    moved = tmp_path / "elsewhere"
    os.replace(repo / "a", moved)
    (repo / "a").symlink_to(moved)  # the damaged checkpoint's folder is now a link

    with pytest.raises(UnsafePathError, match="symbolic link"):
        repair(repo, [replica])

    assert not (moved / "COMMIT").exists()


def test_sync_does_not_write_into_a_linked_destination_folder(repo, tmp_path, capsys):
    dst, elsewhere = tmp_path / "dst", tmp_path / "user-folder"
    Repository.open(dst, create=True)
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("the user's own notes")
    (dst / "a").symlink_to(elsewhere)

    code = main(["sync", str(repo), str(dst)])

    assert code == 2 and "symbolic link" in capsys.readouterr().err
    assert tree(elsewhere) == {"notes.txt": b"the user's own notes"}


def test_the_lightning_plugin_does_not_remove_through_a_linked_pointer(tmp_path, other):
    pytest.importorskip("lightning")
    from ckptfmt.integrations.lightning import CkptfmtCheckpointIO

    plugin = CkptfmtCheckpointIO()
    run = tmp_path / "lit"
    plugin.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, run / "epoch=0.ckpt")
    plugin.teardown()
    elsewhere = tmp_path / "pointer-elsewhere"
    os.replace(run / "epoch=0.ckpt", elsewhere)
    (run / "epoch=0.ckpt").symlink_to(elsewhere)

    plugin.remove_checkpoint(run / "epoch=0.ckpt")
    with pytest.raises(UnsafePathError, match="symbolic link"):
        plugin.teardown()

    assert elsewhere.exists() and (run / "epoch_0" / "COMMIT").exists()


@pytest.mark.parametrize("url", ["repo/../escape", "repo/sub/../../escape", "memory://bucket/repo/../x/ck"])
def test_save_refuses_parent_segments_instead_of_resolving_them(tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidNameError, match=r"'\.\.' segment"):
        ckptfmt.save({"w": torch.ones(2)}, url, step=1)
    assert list(tmp_path.iterdir()) == []  # no folder became a repository


def test_reads_refuse_parent_segments_too(repo):
    for url in (f"{repo}/../repo/a", f"{repo}/a/.."):
        with pytest.raises(InvalidNameError, match=r"'\.\.' segment"):
            ckptfmt.load(url)
    with pytest.raises(InvalidNameError):
        Repository.open(f"{repo}/../repo")


def test_a_leading_parent_segment_of_a_relative_path_is_a_plain_path(repo, monkeypatch):
    monkeypatch.chdir(repo / "a")
    assert torch.equal(ckptfmt.load("../../repo/a")["w"], torch.ones(3))
