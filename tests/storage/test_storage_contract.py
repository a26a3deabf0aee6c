"""The storage contract (tests/support/storage_contract.py) on each backend: local disk, memory://, S3.

Each class gives the contract a fresh storage, says what its backend is, and provides the hooks its
backend can (another client, refusals, links, a missing bucket); tests only one backend has follow.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import stat
import uuid
from pathlib import Path

import pytest

pytest.register_assert_rewrite("tests.support.storage_contract")

from ckptfmt.errors import CorruptDataError
from ckptfmt.storage.base import Storage
from ckptfmt.storage.factory import open_storage
from ckptfmt.storage.local import LocalStorage
from ckptfmt.storage.object_store import ObjectStorage
from tests.support.helpers import within
from tests.support.storage_contract import ANY_SIZE, StorageContract

#: The filesystem uid a root test takes on to be refused (nobody).
NOBODY = 65534


@contextlib.contextmanager
def refused_folder(folder: Path):
    """While inside, this thread may not enter ``folder``: mode 000, and for root (whom no mode stops) another
    filesystem uid for this thread alone (setfsuid is per thread, and drops the capabilities that bypass modes)."""
    mode = stat.S_IMODE(folder.stat().st_mode)
    libc = ctypes.CDLL(None, use_errno=True) if os.geteuid() == 0 else None
    folder.chmod(0)
    try:
        if libc is not None:
            libc.setfsuid(NOBODY)
            if libc.setfsuid(-1) != NOBODY:  # -1 changes nothing and returns the current one
                pytest.skip("cannot take on another filesystem uid to be refused")
        try:
            yield
        finally:
            if libc is not None:
                libc.setfsuid(0)
    finally:
        folder.chmod(mode)


class TestLocalStorage(StorageContract):
    storage_class = LocalStorage
    zero_copy_reads = True
    cheap_exists = True
    has_folders = True
    has_links = True
    has_permissions = True

    @pytest.fixture
    def storage(self, tmp_path) -> Storage:
        return open_storage(tmp_path / "store")

    @pytest.fixture
    def deny(self, storage):
        return lambda folder: refused_folder(Path(storage.path(folder)))

    @pytest.fixture
    def link_outside(self, tmp_path):
        def make(storage: Storage, key: str) -> None:
            outside = tmp_path / f"outside-{uuid.uuid4().hex[:8]}"
            (outside / "empty").mkdir(parents=True)
            (outside / "victim").write_bytes(b"outside")
            link = Path(storage.path(key))
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(outside)
        return make

    # -- local disks only ---------------------------------------------------------------------------
    @pytest.mark.parametrize("kind", ["fifo", "folder"])
    def test_a_file_that_is_not_regular_is_refused_before_a_byte_is_read(self, storage, kind):
        """A FIFO would block a read until a writer comes: refused at once, by every way of reading."""
        storage.write("x", b"")
        path = Path(storage.path("odd"))
        os.mkfifo(path) if kind == "fifo" else path.mkdir()
        described = {"fifo": "a FIFO", "folder": "a folder"}[kind]
        for call in (lambda: storage.read("odd", max_size=ANY_SIZE), lambda: storage.read("odd", max_size=0),
                     lambda: storage.read_into("odd", memoryview(bytearray(4))), lambda: storage.size("odd"),
                     lambda: storage.map("odd", 4)):
            with pytest.raises(CorruptDataError, match=f"not a regular file \\({described}\\)"):
                within(10, call)

    def test_make_durable_fsyncs_each_file_and_every_folder_up_to_the_root(self, storage, monkeypatch):
        """A killed save's objects may have reached no disk, nor their folders' entries."""
        Path(storage.root).mkdir()
        for key in ("chunks/aa/one", "chunks/bb/two"):
            Path(storage.path(key)).parent.mkdir(parents=True, exist_ok=True)
            Path(storage.path(key)).write_bytes(b"found, not written")
        synced = []
        fsync = os.fsync

        def recording(fd: int) -> None:
            synced.append(os.path.relpath(os.readlink(f"/proc/self/fd/{fd}"), storage.root))
            fsync(fd)

        monkeypatch.setattr(os, "fsync", recording)
        storage.make_durable(["chunks/aa/one", "chunks/bb/two"])
        assert sorted(synced) == sorted(["chunks/aa/one", "chunks/bb/two", "chunks/aa", "chunks/bb", "chunks", "."])
        synced.clear()
        storage.write("cp/x", b"1", durable=False)
        storage.sync(["cp/x"])
        assert sorted(synced) == sorted(["cp/x", "cp", "."])  # the folder this storage made has its entry synced


class TestMemoryStorage(StorageContract):
    storage_class = Storage

    @pytest.fixture
    def storage(self, memory_root) -> Storage:
        return open_storage(memory_root)


@pytest.mark.s3
class TestS3Storage(StorageContract):
    storage_class = ObjectStorage
    trusted_create = False
    has_permissions = True
    has_containers = True

    @pytest.fixture
    def storage(self, s3_bucket) -> Storage:
        return open_storage(f"{s3_bucket}/store")

    @pytest.fixture
    def other_client(self, storage) -> Storage:
        return open_storage(storage.url, {"skip_instance_cache": True})  # its own S3FileSystem and listing cache

    @pytest.fixture
    def deny(self, storage, s3_client):
        """A bucket policy refusing every action on the folder's objects (moto enforces it without auth)."""
        bucket, _, prefix = storage.root.partition("/")

        @contextlib.contextmanager
        def refused(folder: str):
            statement = {"Effect": "Deny", "Principal": "*", "Action": "s3:*",
                         "Resource": f"arn:aws:s3:::{bucket}/{prefix}/{folder}/*"}
            s3_client.put_bucket_policy(Bucket=bucket, Policy=json.dumps({"Version": "2012-10-17",
                                                                          "Statement": [statement]}))
            try:
                yield
            finally:
                s3_client.delete_bucket_policy(Bucket=bucket)
        return refused

    @pytest.fixture
    def missing_container(self, s3_server) -> Storage:
        return open_storage(f"s3://ckptfmt-missing-{uuid.uuid4().hex[:12]}/store")
