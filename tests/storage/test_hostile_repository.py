"""Repositories as a hostile or unlucky user leaves them: stray entries, devices, FIFOs, sockets, folders.

Stray entries are ignored (spec 4.1): listing, loading, verifying and saving go
on. Where the format expects an object and finds something that is not a
regular file, the read is refused before a byte is read: nothing hangs on a
FIFO, nothing reads /dev/zero until memory runs out.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

import pytest
import torch

import ckptfmt
from ckptfmt import CheckpointError, InvalidNameError
from ckptfmt.format import layout
from ckptfmt.format.limits import check_name, is_valid_name
from ckptfmt.repository.repository import Repository
from tests.support.helpers import assert_same, within

STATE = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "big": torch.ones(100_000)}


def saved_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    ckptfmt.save(STATE, repo / "a", step=1)
    return repo




# -- stray entries ------------------------------------------------------------------------

STRAYS = {
    "CHUNKS folder": lambda repo: (repo / "CHUNKS").mkdir(),
    "Chunks folder": lambda repo: (repo / "Chunks").mkdir(),
    "CKPTFMT.json file": lambda repo: (repo / "CKPTFMT.json").write_text("{}"),
    "notes folder": lambda repo: ((repo / "notes").mkdir(), (repo / "notes" / "todo.txt").write_text("x")),
    ".DS_Store": lambda repo: (repo / ".DS_Store").write_bytes(b"\0\0\0\1Bud1"),
    "empty folder": lambda repo: (repo / "empty").mkdir(),
    "file with a checkpoint name": lambda repo: (repo / "step-9").write_text("not a folder"),
    "unfinished save": lambda repo: ((repo / "b").mkdir(), (repo / "b" / "manifest-x.msgpack").write_bytes(b"")),
}


@pytest.mark.parametrize("stray", STRAYS)
def test_stray_entries_are_ignored_by_every_reader_and_by_save(tmp_path, stray):
    repo = saved_repo(tmp_path)
    STRAYS[stray](repo)
    assert Repository.open(repo).names() == ["a"]
    assert_same(STATE, ckptfmt.load(repo))
    with ckptfmt.open(repo) as ckpt:
        assert ckpt.name == "a"
    report = ckptfmt.verify(repo)
    assert report.ok and report.checkpoints == ["a"]
    assert len(report.warnings) == 1 and "ignored" in report.warnings[0]
    url = ckptfmt.save(STATE, repo / "c", step=2)
    with ckptfmt.open(url) as ckpt:
        assert ckpt.manifest.parent == "a"  # the save found its parent among the strays
        assert ckpt.manifest.totals["new_bytes"] == 0


def test_reserved_names_are_refused_in_any_case():
    for name in ("chunks", "CHUNKS", "Chunks", "ckptfmt.json", "CkptFmt.JSON"):
        assert not is_valid_name(name)
        with pytest.raises(InvalidNameError):
            check_name(name)
    assert is_valid_name("chunks2") and is_valid_name("my-chunks")


def test_saving_to_a_reserved_name_in_another_case_is_refused(tmp_path):
    with pytest.raises(InvalidNameError, match="Chunks"):
        ckptfmt.save(STATE, tmp_path / "repo" / "Chunks")


# -- objects that are not regular files ---------------------------------------------------------

def make_fifo(path: Path) -> None:
    os.mkfifo(path)


def make_dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def make_folder(path: Path) -> None:
    path.mkdir()


def make_socket(path: Path) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cwd = os.getcwd()
    os.chdir(path.parent)  # socket paths are limited to ~107 bytes: bind by the short name
    try:
        server.bind(path.name)
    finally:
        os.chdir(cwd)
    server.listen(1)
    return server


SPECIALS = {"fifo": make_fifo, "/dev/zero": make_dev_zero, "folder": make_folder, "socket": make_socket}


def object_path(repo: Path, which: str) -> Path:
    """The file of one object of checkpoint 'a': its commit record, manifest, a chunk, or the marker."""
    record = Repository.open(repo).commit("a")
    if which == "commit":
        return repo / layout.commit_key("a")
    if which == "manifest":
        return repo / layout.manifest_key("a", record.manifest_hash)
    if which == "marker":
        return repo / layout.MARKER_KEY
    chunks = sorted((repo / "chunks").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else -1)
    return chunks[-1]  # the biggest chunk file


@pytest.fixture
def special(tmp_path, request):
    """Replace one object of a saved repository by a special file; yields (repo, object kind)."""
    which, kind = request.param
    repo = saved_repo(tmp_path)
    path = object_path(repo, which)
    path.unlink()
    handle = SPECIALS[kind](path)
    yield repo, which
    if handle is not None:
        handle.close()


CASES = [(which, kind) for which in ("commit", "manifest", "chunk", "marker") for kind in SPECIALS]


@pytest.mark.parametrize("special", CASES, indirect=True, ids=[f"{w}-{k}" for w, k in CASES])
def test_special_files_are_refused_without_hanging(special):
    repo, which = special
    for call in (lambda: ckptfmt.load(repo / "a"), lambda: ckptfmt.load(repo / "a", mmap=False),
                 lambda: ckptfmt.open(repo / "a").get_tensor("big")):
        with pytest.raises(CheckpointError) as info:
            within(20, call)
        assert "regular file" in str(info.value) or which == "marker", info.value
    if which == "marker":
        with pytest.raises(CheckpointError, match="regular file"):
            within(20, lambda: ckptfmt.verify(repo))
        return
    report = within(20, lambda: ckptfmt.verify(repo))
    assert not report.ok
    assert any("regular file" in p.message for p in report.problems), report.problems
    with pytest.warns(UserWarning) if which == "commit" else contextlib.nullcontext():
        names = [r.name for r in within(20, lambda: Repository.open(repo).commits())]
    assert names == ([] if which == "commit" else ["a"])


def test_a_chunk_store_that_is_a_file(tmp_path):
    repo = saved_repo(tmp_path)
    for path in sorted((repo / "chunks").rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    (repo / "chunks").rmdir()
    (repo / "chunks").write_text("not a folder")
    with pytest.raises(CheckpointError) as info:
        ckptfmt.load(repo / "a")
    assert "Error" not in str(info.value)  # a message for people, not a Python exception name
    assert not ckptfmt.verify(repo).ok
