"""ckptfmt.storage: the same primitives behave the same on local disk, memory:// and S3."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError, CorruptDataError, StorageError
from ckptfmt.storage.base import Storage
from ckptfmt.storage.factory import open_storage
from ckptfmt.storage.local import LocalStorage
from tests.support.helpers import ANY_SIZE, run_in_threads


@pytest.fixture
def storage(root_url) -> Storage:
    return open_storage(root_url)


def test_open_storage_picks_the_local_specialisation(backend, storage):
    assert isinstance(storage, LocalStorage) == (backend == "local")
    assert storage.zero_copy_reads == (backend == "local")


def test_write_then_read(storage):
    storage.write("a/b/c.bin", b"hello world")
    assert storage.read("a/b/c.bin", max_size=ANY_SIZE) == b"hello world"
    assert storage.size("a/b/c.bin") == 11
    assert storage.exists("a/b/c.bin")


def test_write_replaces_and_accepts_buffers(storage):
    storage.write("k", b"first version, longer")
    values = np.arange(10, dtype=np.float32)
    storage.write("k", memoryview(values))  # any buffer: the writer passes views of tensor memory
    assert storage.read("k", max_size=ANY_SIZE) == values.tobytes()
    storage.write("k", bytearray(b"third"))
    assert storage.read("k", max_size=ANY_SIZE) == b"third"


def test_empty_object(storage):
    storage.write("empty", b"")
    assert storage.read("empty", max_size=ANY_SIZE) == b""
    assert storage.size("empty") == 0
    storage.read_into("empty", memoryview(bytearray()))


def test_read_into_fills_the_buffer(storage):
    payload = os.urandom(1000)
    storage.write("x/blob", payload)
    target = np.zeros(1000, dtype=np.uint8)
    storage.read_into("x/blob", memoryview(target))
    assert target.tobytes() == payload


@pytest.mark.parametrize("length", [999, 1001])
def test_read_into_refuses_a_size_mismatch(storage, length):
    storage.write("blob", b"z" * 1000)
    target = bytearray(length)
    with pytest.raises(CorruptDataError, match="blob"):
        storage.read_into("blob", memoryview(target))


def test_read_max_size(storage):
    storage.write("big", b"0123456789")
    assert storage.read("big", max_size=10) == b"0123456789"
    with pytest.raises(CorruptDataError, match="over the limit of 9") as info:
        storage.read("big", max_size=9)
    assert isinstance(info.value, CheckpointError)
    assert "big" in str(info.value)


def test_missing_key(storage):
    for call in (
        lambda: storage.read("no/such/key", max_size=ANY_SIZE),
        lambda: storage.read("no/such/key", max_size=10),
        lambda: storage.read_into("no/such/key", memoryview(bytearray(4))),
        lambda: storage.read("no/such/key", max_size=0),
    ):
        with pytest.raises(CheckpointNotFoundError) as info:
            call()
        assert isinstance(info.value, CheckpointError)
        assert isinstance(info.value, FileNotFoundError)
        assert "no/such/key" in str(info.value)
    assert not storage.exists("no/such/key")
    assert storage.size("no/such/key") is None


def test_a_zero_bound_means_empty_not_unbounded(storage, monkeypatch):
    """max_size=0 reads only empty objects: a 0 in a manifest never turns into an unbounded read."""
    storage.write("empty", b"")
    storage.write("full", b"x" * 100_000)
    def no_unbounded_reads(path, start=None, end=None, **kwargs):
        assert end is not None, "a read without a bound"
        return real_cat(path, start=start, end=end, **kwargs)

    real_cat = storage.fs.cat_file
    monkeypatch.setattr(storage.fs, "cat_file", no_unbounded_reads)
    assert storage.read("empty", max_size=0) == b""
    with pytest.raises(CorruptDataError, match="full"):
        storage.read("full", max_size=0)


def test_list_names_direct_children_only(storage):
    assert storage.list("") == []
    assert storage.list("nothing/here") == []
    storage.write("d/one", b"1")
    storage.write("d/two", b"2")
    storage.write("d/sub/three", b"3")
    storage.write("top", b"t")
    assert storage.list("d") == ["one", "sub", "two"]
    assert storage.list("d/sub") == ["three"]
    assert storage.list("") == ["d", "top"]


def test_list_sees_writes_by_another_storage_object(root_url):
    """list() must not answer from a stale cache: another writer may have added entries."""
    first = open_storage(root_url)
    first.write("d/a", b"1")
    assert first.list("d") == ["a"]
    open_storage(root_url).write("d/b", b"2")
    assert first.list("d") == ["a", "b"]


def test_delete(storage):
    storage.write("d/x", b"1")
    storage.write("d/y", b"2")
    storage.delete("d/x")
    assert not storage.exists("d/x")
    assert storage.list("d") == ["y"]
    with pytest.raises(CheckpointNotFoundError):
        storage.read("d/x", max_size=ANY_SIZE)
    storage.delete("d/x")  # deleting what is gone is not an error


def test_create_is_write_once(storage):
    storage.create("c/COMMIT", b"winner")
    assert storage.read("c/COMMIT", max_size=ANY_SIZE) == b"winner"
    with pytest.raises(FileExistsError):
        storage.create("c/COMMIT", b"loser")
    assert storage.read("c/COMMIT", max_size=ANY_SIZE) == b"winner"
    # A key written by plain write() counts as existing too.
    storage.write("c/other", b"x")
    with pytest.raises(FileExistsError):
        storage.create("c/other", b"y")
    assert storage.read("c/other", max_size=ANY_SIZE) == b"x"


def test_create_on_s3_is_a_conditional_put(s3_bucket, monkeypatch):
    """Even when the client believes the key is absent, the server refuses the second create."""
    storage = open_storage(f"{s3_bucket}/repo")
    storage.create("name/COMMIT", b"first")

    def absent(*args, **kwargs):
        raise FileNotFoundError("pretend")

    # A check-then-write implementation would consult these and overwrite.
    monkeypatch.setattr(storage.fs, "exists", lambda *a, **k: False)
    monkeypatch.setattr(storage.fs, "info", absent)
    monkeypatch.setattr(storage.fs, "_info", absent, raising=False)
    with pytest.raises(FileExistsError):
        storage.create("name/COMMIT", b"second")
    monkeypatch.undo()
    assert open_storage(f"{s3_bucket}/repo").read("name/COMMIT", max_size=ANY_SIZE) == b"first"


def test_local_create_race_has_one_winner(tmp_path):
    storage = open_storage(tmp_path / "store")
    barrier = threading.Barrier(8)
    winners, losers = [], []

    def attempt(i: int) -> None:
        barrier.wait()
        try:
            storage.create("race/COMMIT", f"writer {i}".encode())
            winners.append(i)
        except FileExistsError:
            losers.append(i)

    run_in_threads(attempt, 8)
    assert len(winners) == 1 and len(losers) == 7
    assert storage.read("race/COMMIT", max_size=ANY_SIZE) == f"writer {winners[0]}".encode()
    assert storage.list("race") == ["COMMIT"]  # no temp files left behind


def test_local_writes_leave_no_temp_files(tmp_path):
    storage = open_storage(tmp_path / "store")
    storage.write("a/b", b"1")
    storage.write("a/b", b"2")
    storage.create("a/c", b"3")
    with pytest.raises(FileExistsError):
        storage.create("a/c", b"4")
    assert sorted(os.listdir(tmp_path / "store" / "a")) == ["b", "c"]


def test_child_storage(storage):
    child = storage.child("sub")
    child.write("x", b"inner")
    assert storage.read("sub/x", max_size=ANY_SIZE) == b"inner"
    assert child.list("") == ["x"]
    assert child.describe("x") == storage.describe("sub/x")


def test_describe_names_the_url(root_url, storage):
    assert storage.describe("a/b") == f"{root_url}/a/b"
    assert storage.describe("") == root_url


def test_unknown_protocol_is_a_storage_error():
    with pytest.raises(StorageError) as info:
        open_storage("nosuchprotocol-xyz://bucket/path")
    assert isinstance(info.value, CheckpointError)



def test_a_save_fsyncs_each_file_once(tmp_path, monkeypatch):
    """Durability costs one fsync per file a save writes (folders get theirs as entries arrive): the
    marker, manifest, index entry and commit record were fsynced twice each (on the temporary file,
    then on its key)."""
    import collections
    import fnmatch
    import re
    import stat

    import torch

    import ckptfmt

    synced: collections.Counter = collections.Counter()  # files by key (a temporary file's by its key)
    fsync = os.fsync
    repo = tmp_path / "repo"

    def counting(fd):
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            folder, name = os.path.split(os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)"))
            temporary = re.fullmatch(r"\.(.+)\.tmp-[0-9a-f]{12}", name)
            synced[os.path.relpath(os.path.join(folder, temporary[1] if temporary else name), repo)] += 1
        return fsync(fd)
    monkeypatch.setattr(os, "fsync", counting)

    def files() -> dict[str, int]:
        found = dict(synced)
        synced.clear()
        return found
    ckptfmt.save({"w": torch.ones(10)}, repo / "first")
    first = files()
    assert set(first.values()) == {1}, first
    assert {"ckptfmt.json", "first/COMMIT"} <= set(first) and len(first) == 5, first  # + chunk, manifest, entry
    ckptfmt.save({"w": torch.ones(10)}, repo / "second")  # its chunk is stored already
    second = files()
    assert set(second.values()) == {1}, second
    patterns = ["second/manifest-*.msgpack", "_index/e/*.second.*", "second/COMMIT"]
    assert sorted(second) == sorted(next(p for p in second if fnmatch.fnmatch(p, pattern)) for pattern in patterns)


def test_an_os_failure_keeps_its_errno_and_cause(tmp_path):
    """Translated at the storage boundary, an OS error stays inspectable: its errno, and the OSError itself."""
    import errno

    (tmp_path / "repo").mkdir()
    storage = open_storage(tmp_path / "repo")
    with pytest.raises(StorageError, match="File name too long") as info:
        storage.read("x" * 300, max_size=10)  # longer than any file name ext4 allows
    assert info.value.errno == errno.ENAMETOOLONG
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENAMETOOLONG


def test_a_storage_error_keeps_its_errno_when_pickled():
    """The replication child sends errors back pickled."""
    import errno
    import pickle

    error = pickle.loads(pickle.dumps(StorageError("s3://b/k: permission denied", errno.EACCES)))
    assert type(error) is StorageError and str(error) == "s3://b/k: permission denied"
    assert error.errno == errno.EACCES
