"""ckptfmt.storage beyond the contract every backend keeps (tests/storage/test_storage_contract.py): how
fsspec stores bound their reads, S3's conditional PUT, the factory's errors, fsyncs per save, errno kept."""

from __future__ import annotations

import os

import pytest

from ckptfmt.errors import CheckpointError, CorruptDataError, StorageError
from ckptfmt.storage.factory import open_storage
from tests.support.helpers import ANY_SIZE


@pytest.mark.parametrize("backend", ["memory", "s3"])
def test_fsspec_reads_ask_for_a_bounded_range(root_url):
    """On fsspec's stores (``Storage.read`` through ``cat_file``) every GET is ranged: a 0 bound asks for the
    size instead, a bound of n for n + 1 bytes. (That a 0 bound reads only empty objects, everywhere, is the
    contract's: tests/support/storage_contract.py.)"""
    storage = open_storage(root_url)
    storage.write("empty", b"")
    storage.write("full", b"x" * 100_000)
    ranges = []

    def bounded_reads_only(path, start=None, end=None, **kwargs):
        assert end is not None, "a read without a bound"
        ranges.append((start, end))
        return real_cat(path, start=start, end=end, **kwargs)

    real_cat = storage.fs.cat_file
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(storage.fs, "cat_file", bounded_reads_only)
        assert storage.read("empty", max_size=0) == b""
        with pytest.raises(CorruptDataError, match="full"):
            storage.read("full", max_size=0)
        with pytest.raises(CorruptDataError, match="full"):
            storage.read("full", max_size=10)
        assert storage.read("full", max_size=ANY_SIZE) == b"x" * 100_000
    assert ranges == [(0, 11), (0, ANY_SIZE + 1)]


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


def test_windows_of_a_local_file_are_read_where_asked(tmp_path):
    """``read_windows`` reads small spans without mapping (a fingerprint's 16 windows of a chunk file);
    a file shorter than a window asked for is damage, named; storages without cheap reads say None."""
    storage = open_storage(str(tmp_path))
    storage.write("chunks/a", bytes(range(256)) * 4)
    assert storage.read_windows("chunks/a", [0, 250, 1020], 4) == bytes([0, 1, 2, 3, 250, 251, 252, 253, 252, 253,
                                                                            254, 255])
    with pytest.raises(CorruptDataError, match="chunks/a"):
        storage.read_windows("chunks/a", [1022], 4)
    assert open_storage("memory://windows").read_windows("chunks/a", [0], 4) is None
