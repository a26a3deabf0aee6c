"""The storage contract: what the repository relies on from a ``Storage``, one test per promise.

As zarr's ``StoreTests`` does for its stores, ``StorageContract`` is a test class without
a backend: ``tests/storage/test_storage_contract.py`` runs it on local disk, memory:// and S3
(the moto server), each a small subclass that provides the ``storage`` fixture (a fresh, empty
storage, opened through ``open_storage``) and says what its backend is (the flags below). A new
backend is supported by adding a subclass: docs/storage.md says how.

The promises, and who relies on them (ckptfmt/repository/, saving/chunk_writer.py,
lifecycle/gc.py, loading/chunkio.py):

reads
  ``read(key, max_size=)``  the object's bytes, never more than ``max_size`` read: a bigger object is a
                            CorruptDataError naming the key; ``max_size=0`` reads only an empty object
                            (a 0 in a manifest never becomes an unbounded read)
  ``read_into(key, buf)``   fills ``buf``; an object of another length is a CorruptDataError (chunkio)
  ``read_checked``          ``check(bytes)``; the check's CorruptDataError leaves it (object stores read
                            again first: bytes damaged in transit differ from read to read)
  ``map(key, size)``        a private copy-on-write map where ``zero_copy_reads``, None elsewhere
  ``size``, ``exists``      None and False for a missing key, also below an object; ``exists`` is true
                            for a folder or prefix (a repository without marker but with ``chunks/``)
listings
  ``list(key)``             names directly under ``key``, sorted, each once; empty for a missing key and
                            for an object (the repository, leases, signatures, lost commits)
  ``find(key)``             every object below ``key``, recursively, {key: size}; no folders (gc)
  both, ``exists``, ``size`` see what another client wrote or deleted since, even right after a listing
writes
  ``write``                 replaces, atomically for readers; accepts any buffer; leaves no temporary
                            object behind
  ``create``                write-once: FileExistsError when the key exists (commit records, the marker);
                            racing creators have one winner where the create is trusted
                            (``create_settle_s is None``), else the repository reads the record back
  ``stage``                 blocks gathered under no key until ``publish`` (chunks streamed as hashed);
                            ``discard`` leaves nothing, and is harmless after ``publish``
  ``sync``, ``make_durable``  accept written keys (durable on local disks, no-ops on object stores)
  ``delete``, ``delete_many``  absent keys are no error; exactly the named keys go, taken literally
  ``makedirs``, ``remove_folder``  folders where the backend has them; ``remove_folder`` never removes
                            an object
  ``refuse_links``          destructive operations never act through a symbolic link (local disks)
naming
  ``child(key)``            the same kind of storage rooted below, same flags; ``describe(key)`` the URL
  ``missing_container``     None for an empty root; names a missing bucket
errors
  a missing object is a CheckpointNotFoundError (a FileNotFoundError) naming the key; a refusal by the
  backend is a StorageError with errno EACCES (or EPERM) and the backend's PermissionError as cause;
  whatever else fails leaves as a CheckpointError

A promise only some backends have is marked ``only_where(flag=value)``: a subclass whose flags differ
does not collect it. A promise a backend is known to break is named in its ``known_bugs``, with what
happens, and runs as a strict xfail.
"""

from __future__ import annotations

import contextlib
import errno
import sys
import threading
from collections.abc import Callable

import numpy as np
import pytest

from ckptfmt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptDataError,
    StorageError,
    UnsafePathError,
)
from ckptfmt.storage.base import Storage
from ckptfmt.storage.factory import open_storage

#: A bound for reads that take whole objects back.
ANY_SIZE = 2**40

#: ``deny(folder)``: a context in which the backend refuses access to the objects in ``folder``.
Deny = Callable[[str], contextlib.AbstractContextManager]


def only_where(**flags: bool) -> Callable:
    """A promise of the backends whose flags have these values; a subclass without them does not collect it."""
    def mark(test: Callable) -> Callable:
        test.only_where = flags  # type: ignore[attr-defined]
        return test
    return mark


class StorageContract:
    """The promises every storage backend keeps. Subclass it as ``Test<Backend>Storage``, provide the
    ``storage`` fixture and set the flags; override the hook fixtures where the backend can."""

    #: The class ``open_storage`` must pick for the backend's URLs.
    storage_class: type[Storage] = Storage
    #: ``read_into`` goes straight into caller memory and ``map`` maps files (local disks).
    zero_copy_reads = False
    #: ``exists`` and ``size`` are a stat, not a request (local disks).
    cheap_exists = False
    #: ``create`` is write-once on its own (``create_settle_s is None``); False: the repository reads
    #: commit records back (object stores, whose conditional PUT cannot be taken on trust).
    trusted_create = True
    #: Empty folders exist, made by ``makedirs`` and removed by ``remove_folder``.
    has_folders = False
    #: Symbolic links exist, and destructive operations refuse them (the ``link_outside`` fixture).
    has_links = False
    #: The backend can refuse access, and the ``deny`` fixture makes it.
    has_permissions = False
    #: Roots live in containers that may not exist (buckets), and the ``missing_container`` fixture gives one.
    has_containers = False
    #: Promises the backend is known to break: test name -> what happens. Each runs as a strict xfail, so
    #: that the suite stays green and the entry must go once the backend is fixed.
    known_bugs: dict[str, str] = {}

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for name in [name for name in dir(cls) if name.startswith("test_")]:
            flags = getattr(getattr(cls, name), "only_where", {})
            if any(getattr(cls, flag) != value for flag, value in flags.items()):
                setattr(cls, name, None)  # another kind of backend's promise: pytest collects no test here

    # -- what a subclass provides ------------------------------------------------------------------
    @pytest.fixture
    def storage(self) -> Storage:
        raise NotImplementedError("a StorageContract subclass provides the storage fixture: a fresh, empty storage")

    @pytest.fixture
    def other_client(self, storage) -> Storage:
        """The same root as another process sees it: its own client, no cache shared with ``storage``."""
        return open_storage(storage.url)

    @pytest.fixture
    def deny(self) -> Deny | None:
        """``deny(folder)``, a context in which the backend refuses access to the objects in ``folder``
        (``has_permissions``)."""
        return None

    @pytest.fixture
    def link_outside(self) -> Callable[[Storage, str], None] | None:
        """``link_outside(storage, key)`` makes ``key`` a symbolic link to a folder outside the storage
        that holds an object ``victim`` (b"outside") and an empty folder ``empty`` (``has_links``)."""
        return None

    @pytest.fixture
    def missing_container(self) -> Storage | None:
        """A storage whose container (a bucket) does not exist (``has_containers``)."""
        return None

    @pytest.fixture(autouse=True)
    def _known_bug(self, request) -> None:
        unknown = {name for name in self.known_bugs
                   if not name.startswith("test_") or not callable(getattr(self, name, None))}
        assert not unknown, f"known_bugs names no test this class runs: {sorted(unknown)}"
        reason = self.known_bugs.get(request.function.__name__)
        if reason is not None:
            request.applymarker(pytest.mark.xfail(strict=True, reason=reason))

    # -- what the storage declares -------------------------------------------------------------------
    def test_open_storage_picks_the_backends_class(self, storage):
        assert type(storage) is self.storage_class
        assert storage.zero_copy_reads == self.zero_copy_reads
        assert storage.cheap_exists == self.cheap_exists

    def test_create_settle_s_says_whether_create_is_trusted(self, storage):
        """An untrusted create needs a positive delay between the repository's two read-backs."""
        settle_s = storage.create_settle_s
        assert (settle_s is None) == self.trusted_create
        assert settle_s is None or settle_s > 0

    # -- reads ------------------------------------------------------------------------------------------
    def test_write_then_read(self, storage):
        storage.write("a/b/c.bin", b"hello world")
        assert storage.read("a/b/c.bin", max_size=ANY_SIZE) == b"hello world"
        assert storage.size("a/b/c.bin") == 11
        assert storage.exists("a/b/c.bin")

    def test_write_replaces_and_accepts_buffers(self, storage):
        storage.write("k", b"first version, longer")
        values = np.arange(10, dtype=np.float32)
        storage.write("k", memoryview(values))  # any buffer: the writer passes views of tensor memory
        assert storage.read("k", max_size=ANY_SIZE) == values.tobytes()
        assert storage.size("k") == 40
        storage.write("k", bytearray(b"third"))
        assert storage.read("k", max_size=ANY_SIZE) == b"third"

    def test_empty_object(self, storage):
        storage.write("empty", b"")
        assert storage.read("empty", max_size=ANY_SIZE) == b""
        assert storage.read("empty", max_size=0) == b""
        assert storage.size("empty") == 0 and storage.exists("empty")
        storage.read_into("empty", memoryview(bytearray()))

    def test_read_is_bounded(self, storage):
        storage.write("big", b"0123456789")
        assert storage.read("big", max_size=10) == b"0123456789"
        assert storage.read("big", max_size=11) == b"0123456789"
        for bound in (9, 1):
            with pytest.raises(CorruptDataError, match=f"over the limit of {bound}") as info:
                storage.read("big", max_size=bound)
            assert storage.describe("big") in str(info.value)

    def test_a_zero_bound_means_empty_not_unbounded(self, storage):
        """max_size=0 reads only empty objects: a 0 in a manifest never turns into an unbounded read."""
        storage.write("full", b"x" * 100_000)
        with pytest.raises(CorruptDataError, match="over the limit of 0") as info:
            storage.read("full", max_size=0)
        assert storage.describe("full") in str(info.value)

    def test_read_into_fills_the_buffer(self, storage):
        payload = bytes(range(256)) * 40
        storage.write("x/blob", payload)
        target = np.zeros(len(payload), dtype=np.uint8)
        storage.read_into("x/blob", memoryview(target))
        assert target.tobytes() == payload

    @pytest.mark.parametrize("length", [999, 1001, 0])
    def test_read_into_refuses_a_size_mismatch(self, storage, length):
        storage.write("blob", b"z" * 1000)
        target = bytearray(length)
        with pytest.raises(CorruptDataError) as info:
            storage.read_into("blob", memoryview(target))
        assert storage.describe("blob") in str(info.value)

    def test_read_checked_returns_the_checks_result(self, storage):
        storage.write("doc", b'{"a": 1}')
        assert storage.read_checked("doc", max_size=100, check=lambda data: data[::-1]) == b'}1 :"a"{'

    def test_read_checked_lets_a_failed_check_stand(self, storage):
        """Bytes that fail their check in the store stay an error: read again at most a few times, the same
        bytes each time (object stores), never an endless loop nor a silent success."""
        storage.write("doc", b"damaged")
        seen = []

        def check(data: bytes) -> bytes:
            seen.append(data)
            raise CorruptDataError(f"{storage.describe('doc')}: bad")

        with pytest.raises(CorruptDataError, match="bad"):
            storage.read_checked("doc", max_size=100, check=check)
        assert 1 <= len(seen) <= 2 and set(seen) == {b"damaged"}
        with pytest.raises(CorruptDataError, match="over the limit"):  # the bound holds before any check
            storage.read_checked("doc", max_size=3, check=bytes)

    @only_where(zero_copy_reads=True)
    def test_map_is_a_private_copy_where_reads_are_zero_copy(self, storage):
        storage.write("m", b"mapped bytes")
        mapping = storage.map("m", 12)
        assert mapping is not None and mapping[:] == b"mapped bytes"
        mapping[:6] = b"CHANGE"  # copy-on-write: the stored object stays as it was
        assert storage.read("m", max_size=ANY_SIZE) == b"mapped bytes"
        mapping.close()
        assert storage.map("empty-needs-no-map", 0) is None
        for expected in (13, 11):  # shorter or longer than the manifest says: refused, sizes named
            with pytest.raises(CorruptDataError, match=f"12 bytes, expected {expected}"):
                storage.map("m", expected)
        storage.write("empty", b"")
        with pytest.raises(CorruptDataError, match="0 bytes, expected 4"):
            storage.map("empty", 4)
        with pytest.raises(CheckpointNotFoundError):
            storage.map("missing", 4)

    @only_where(zero_copy_reads=False)
    def test_map_is_none_without_zero_copy_reads(self, storage):
        storage.write("m", b"mapped bytes")
        assert storage.map("m", 12) is None

    # -- missing objects ----------------------------------------------------------------------------
    def test_a_missing_key_is_not_found(self, storage):
        for call in (
            lambda: storage.read("no/such/key", max_size=ANY_SIZE),
            lambda: storage.read("no/such/key", max_size=10),
            lambda: storage.read("no/such/key", max_size=0),
            lambda: storage.read_into("no/such/key", memoryview(bytearray(4))),
            lambda: storage.read_into("no/such/key", memoryview(bytearray())),
            lambda: storage.read_checked("no/such/key", max_size=10, check=bytes),
        ):
            with pytest.raises(CheckpointNotFoundError) as info:
                call()
            assert isinstance(info.value, FileNotFoundError)  # callers' `except FileNotFoundError` keeps working
            assert storage.describe("no/such/key") in str(info.value)
        assert not storage.exists("no/such/key")
        assert storage.size("no/such/key") is None

    def test_a_key_below_an_object_is_missing(self, storage):
        """A folder on the key's path is an object (a hostile or damaged repository): nothing is there."""
        storage.write("d/file", b"abc")
        with pytest.raises(CheckpointNotFoundError):
            storage.read("d/file/x", max_size=10)
        assert storage.size("d/file/x") is None
        assert not storage.exists("d/file/x")
        assert storage.list("d/file/x") == []

    def test_a_folder_is_not_an_object_but_exists(self, storage):
        """``exists`` of a folder (a prefix) is true: a repository that lost its marker is told apart by its
        ``chunks/``. Reading it is an error, never bytes."""
        storage.write("d/sub/x", b"1")
        assert storage.exists("d") and storage.exists("d/sub")
        with pytest.raises((CheckpointNotFoundError, CorruptDataError)):
            storage.read("d", max_size=ANY_SIZE)

    def test_a_missing_or_empty_root_is_empty(self, storage):
        """A repository not created yet: nothing is there, and that is no error."""
        assert storage.missing_container() is None
        assert storage.list("") == [] and storage.find("") == {}
        absent = storage.child("never/created")
        assert absent.missing_container() is None
        assert absent.list("") == [] and absent.find("") == {} and not absent.exists("x")

    @only_where(has_containers=True)
    def test_a_missing_container_is_named(self, missing_container):
        assert missing_container is not None, "a backend with containers provides the missing_container fixture"
        reason = missing_container.missing_container()
        bucket = missing_container.url.split("://", 1)[1].split("/", 1)[0]
        assert reason is not None and bucket in reason
        assert missing_container.list("") == [] and not missing_container.exists("k")
        with pytest.raises(CheckpointNotFoundError):
            missing_container.read("k", max_size=10)

    # -- listings -------------------------------------------------------------------------------------------
    def test_list_names_direct_children_only(self, storage):
        assert storage.list("") == []
        assert storage.list("nothing/here") == []
        storage.write("d/one", b"1")
        storage.write("d/two", b"2")
        storage.write("d/sub/three", b"3")
        storage.write("d/sub/four", b"4")
        storage.write("top", b"t")
        assert storage.list("d") == ["one", "sub", "two"]  # sorted, a folder named once
        assert storage.list("d/sub") == ["four", "three"]
        assert storage.list("") == ["d", "top"]

    def test_list_of_an_object_is_empty(self, storage):
        """An object has no entries: listing a checkpoint name that is a stray file finds no checkpoint
        folder (``Repository.remove``, ``gc --remove``, signatures, lost commits)."""
        storage.write("step-9", b"not a folder")
        storage.write("d/file", b"x")
        assert storage.list("step-9") == []
        assert storage.list("d/file") == []

    def test_find_is_recursive_with_sizes(self, storage):
        storage.write("d/one", b"1")
        storage.write("d/sub/deeper/three", b"333")
        storage.write("dx", b"22")  # shares a prefix with "d", but is not below it
        storage.write("top", b"")
        assert storage.find("") == {"d/one": 1, "d/sub/deeper/three": 3, "dx": 2, "top": 0}
        assert storage.find("d") == {"d/one": 1, "d/sub/deeper/three": 3}
        assert storage.find("d/sub") == {"d/sub/deeper/three": 3}
        assert storage.find("nothing/here") == {}

    def test_find_leaves_folders_out(self, storage):
        storage.makedirs("empty/folder")
        storage.write("full/x", b"1")
        storage.delete("full/x")  # a folder emptied by a delete
        storage.write("kept/y", b"2")
        assert storage.find("") == {"kept/y": 1}

    def test_another_client_sees_writes_and_deletes(self, storage, other_client):
        """Another process writes and deletes between two looks: nothing answers from a stale cache, not even
        ``exists`` and ``size`` right after a listing of the same folder."""
        storage.write("d/old", b"123")
        assert storage.list("d") == ["old"] and storage.find("d") == {"d/old": 3}
        other_client.write("d/new", b"4567")
        other_client.delete("d/old")
        assert storage.exists("d/new") and storage.size("d/new") == 4
        assert not storage.exists("d/old") and storage.size("d/old") is None
        assert storage.list("d") == ["new"]
        assert storage.find("d") == {"d/new": 4}
        assert storage.list("d") == ["new"]
        other_client.write("d/new", b"89")  # replaced
        assert storage.size("d/new") == 2
        assert storage.read("d/new", max_size=ANY_SIZE) == b"89"
        other_client.write("d/third", b"3")
        assert storage.list("d") == ["new", "third"]
        assert storage.exists("d/third")

    # -- writes ---------------------------------------------------------------------------------------------------
    def test_write_is_atomic_for_readers(self, storage):
        """A reader sees the old object or the new one, never a mixture or a part (a chunk rewritten over a
        damaged copy, a lease renewed, the marker upgraded while others read)."""
        versions = (b"a" * 256 * 1024, b"b" * 100 * 1024)
        storage.write("k", versions[0])
        done = threading.Event()
        errors: list[BaseException] = []

        def writer() -> None:
            try:
                for i in range(30):
                    storage.write("k", versions[(i + 1) % 2], durable=False)
            except BaseException as exc:  # reported by the test thread
                errors.append(exc)
            finally:
                done.set()

        thread = threading.Thread(target=writer)
        thread.start()
        reads = []
        try:
            while not done.is_set() or not reads:
                reads.append(storage.read("k", max_size=ANY_SIZE))
        finally:
            thread.join()
        assert errors == []
        assert all(data in versions for data in reads), sorted({len(data) for data in reads})

    def test_writes_leave_no_temporary_objects(self, storage):
        storage.write("a/b", b"1")
        storage.write("a/b", b"2")
        storage.write("a/n", b"3", durable=False)
        storage.create("a/c", b"4")
        with pytest.raises(FileExistsError):
            storage.create("a/c", b"5")
        assert storage.find("") == {"a/b": 1, "a/n": 1, "a/c": 1}
        assert storage.list("a") == ["b", "c", "n"]

    def test_create_is_write_once(self, storage):
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
        storage.create("new/folders/below/MARKER", b"m")  # folders on the way are made
        assert storage.read("new/folders/below/MARKER", max_size=ANY_SIZE) == b"m"

    @only_where(trusted_create=True)
    def test_racing_creates_have_one_winner(self, storage):
        """Where ``create`` is trusted, racing creators of one key have exactly one winner, whose bytes stay:
        the repository takes a create's success as the commit (where it is not trusted, it reads back)."""
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # threads switch as often as they can: a check-then-write shows
        try:
            for attempt in range(300):  # a check-then-write loses within a few dozen tries
                key = f"race-{attempt}/COMMIT"
                barrier = threading.Barrier(8)
                winners: list[int] = []
                errors: list[BaseException] = []

                def create(i: int, key=key, barrier=barrier, winners=winners, errors=errors) -> None:
                    barrier.wait()
                    try:
                        storage.create(key, f"writer {i}".encode())
                        winners.append(i)
                    except FileExistsError:
                        pass
                    except BaseException as exc:  # reported by the test thread
                        errors.append(exc)

                threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                assert errors == [] and len(winners) == 1, (attempt, winners, errors)
                assert storage.read(key, max_size=ANY_SIZE) == f"writer {winners[0]}".encode()
        finally:
            sys.setswitchinterval(interval)
        assert storage.list("race-0") == ["COMMIT"]  # no temporary files left behind

    # -- staged objects ---------------------------------------------------------------------------------------
    def test_a_staged_object_is_under_no_key_until_published(self, storage):
        storage.write("chunks/kept", b"k")
        staged = storage.stage("chunks")
        staged.write(b"abc")
        staged.write(memoryview(np.frombuffer(b"defg", dtype=np.uint8)))
        before = storage.find("")
        assert not storage.exists("chunks/ab/abcdefg")
        # At most a temporary name (spec 11.2: ".<name>.tmp-<hex>", which readers and saves ignore).
        assert all(key.rsplit("/", 1)[-1].startswith(".") and ".tmp-" in key
                   for key in set(before) - {"chunks/kept"}), before
        staged.publish("chunks/ab/abcdefg", durable=False)
        assert storage.read("chunks/ab/abcdefg", max_size=ANY_SIZE) == b"abcdefg"
        staged.discard()  # the writer discards in a `finally`, published or not: harmless after publish
        assert storage.find("") == {"chunks/kept": 1, "chunks/ab/abcdefg": 7}

    def test_a_discarded_stage_leaves_nothing(self, storage):
        storage.write("chunks/kept", b"k")
        staged = storage.stage("chunks")
        staged.write(b"x" * 1000)
        staged.discard()
        staged.discard()
        assert storage.find("") == {"chunks/kept": 1}

    def test_publishing_replaces_an_object(self, storage):
        """A damaged copy of a chunk is replaced by writing the chunk again."""
        storage.write("chunks/ab/key", b"damaged")
        staged = storage.stage("chunks")
        staged.write(b"good bytes")
        staged.publish("chunks/ab/key")
        assert storage.read("chunks/ab/key", max_size=ANY_SIZE) == b"good bytes"
        assert storage.find("chunks") == {"chunks/ab/key": 10}

    # -- durability ---------------------------------------------------------------------------------------------
    def test_sync_and_make_durable_accept_written_keys(self, storage):
        """A save writes its chunks with durable=False, then syncs them (and make_durable the chunks a killed
        save left) in one pass: the objects are whole and readable after, in new folders too."""
        storage.write("chunks/aa/one", b"1" * 100, durable=False)
        storage.write("chunks/bb/cc/two", b"2" * 10, durable=False)
        staged = storage.stage("chunks")
        staged.write(b"3")
        staged.publish("chunks/dd/three", durable=False)
        storage.sync(["chunks/aa/one", "chunks/dd/three"])
        storage.make_durable(["chunks/bb/cc/two"])
        storage.sync([])
        storage.make_durable([])
        assert storage.find("") == {"chunks/aa/one": 100, "chunks/bb/cc/two": 10, "chunks/dd/three": 1}
        assert storage.read("chunks/bb/cc/two", max_size=ANY_SIZE) == b"2" * 10

    # -- deletes ------------------------------------------------------------------------------------------------
    def test_delete(self, storage):
        storage.write("d/x", b"1")
        storage.write("d/y", b"2")
        storage.delete("d/x")
        assert not storage.exists("d/x") and storage.size("d/x") is None
        assert storage.list("d") == ["y"]
        with pytest.raises(CheckpointNotFoundError):
            storage.read("d/x", max_size=ANY_SIZE)
        storage.delete("d/x")  # deleting what is gone is not an error
        storage.delete("never/was")

    def test_delete_many_deletes_exactly_the_named_keys(self, storage):
        """gc deletes candidates in batches; another gc or a removal may have deleted some already."""
        for key in ("d/a", "d/ab", "d/b", "d/sub/c", "e/a"):
            storage.write(key, b"1")
        storage.delete_many(["d/a", "d/b", "d/gone", "d/sub/c", "zz/never"])  # absent keys on both sides
        assert storage.find("") == {"d/ab": 1, "e/a": 1}
        storage.delete_many([])
        storage.delete_many(["d/gone", "zz/never"])
        assert storage.find("") == {"d/ab": 1, "e/a": 1}

    def test_delete_many_takes_keys_literally(self, storage):
        """A key is a name, never a pattern: a repository whose folder has glob characters in its name
        (``runs[12]``) deletes its own objects, not those of ``runs1`` and ``runs2`` beside it."""
        for key in ("runs1/k", "runs2/k", "runs[12]/k", "runs*/k"):
            storage.write(key, b"1")
        storage.child("runs[12]").delete_many(["k"])
        storage.child("runs*").delete_many(["k"])
        assert storage.find("") == {"runs1/k": 1, "runs2/k": 1}

    # -- folders ------------------------------------------------------------------------------------------------
    def test_remove_folder_never_removes_objects(self, storage):
        storage.write("name/COMMIT", b"c")
        storage.write("name/sub/x", b"x")
        storage.remove_folder("name")
        storage.remove_folder("name/sub")
        storage.remove_folder("never/was")
        assert storage.find("") == {"name/COMMIT": 1, "name/sub/x": 1}

    @only_where(has_folders=True)
    def test_empty_folders_are_made_and_removed(self, storage):
        storage.makedirs("a/b")
        storage.makedirs("a/b")  # again: no error
        assert storage.list("") == ["a"] and storage.list("a") == ["b"]
        assert storage.exists("a/b")
        storage.remove_folder("a/b")
        assert storage.list("a") == []
        storage.write("w/x", b"1")
        storage.delete("w/x")
        storage.remove_folder("w")  # a checkpoint's folder, emptied by gc
        assert storage.list("") == ["a"]

    @only_where(has_folders=False)
    def test_without_folders_makedirs_leaves_nothing(self, storage):
        storage.makedirs("a/b")
        assert storage.list("") == [] and storage.find("") == {} and not storage.exists("a")
        storage.write("w/x", b"1")
        storage.delete("w/x")
        assert storage.list("") == [] and not storage.exists("w")  # no empty folder stays behind

    # -- links ----------------------------------------------------------------------------------------------------
    @only_where(has_links=True)
    def test_destructive_operations_refuse_links(self, storage, link_outside):
        """A link in the repository to another repository's checkpoint (or a user's files): nothing deletes or
        replaces through it."""
        assert link_outside is not None, "a backend with links provides the link_outside fixture"
        link_outside(storage, "linked")
        link_outside(storage, "deep/er")
        assert storage.read("linked/victim", max_size=ANY_SIZE) == b"outside"  # reading follows it
        refused = {
            "write": lambda: storage.write("linked/victim", b"replaced"),
            "write below": lambda: storage.write("deep/er/victim", b"replaced"),
            "create": lambda: storage.create("linked/new", b"new"),
            "delete": lambda: storage.delete("linked/victim"),
            "delete_many": lambda: storage.delete_many(["deep/er/victim"]),
            "remove_folder": lambda: storage.remove_folder("linked/empty"),
            "publish": lambda: _publish(storage, "linked/victim"),
            "refuse_links": lambda: storage.refuse_links("linked/victim"),
        }
        for what, call in refused.items():
            with pytest.raises(UnsafePathError, match="symbolic link"):
                call()
            assert storage.read("linked/victim", max_size=ANY_SIZE) == b"outside", what
            assert storage.read("deep/er/victim", max_size=ANY_SIZE) == b"outside", what
            assert not storage.exists("linked/new") and storage.exists("linked/empty"), what
        storage.refuse_links("deep/other")  # no link on the way: no refusal

    @only_where(has_links=False)
    def test_without_links_refuse_links_never_refuses(self, storage):
        storage.write("linked/victim", b"x")
        for key in ("linked/victim", "linked", "never/was", ""):
            storage.refuse_links(key)
        storage.refuse_links("linked/victim", set())

    # -- naming -----------------------------------------------------------------------------------------------------
    def test_describe_names_the_url(self, storage):
        assert storage.describe("a/b") == f"{storage.url}/a/b"
        assert storage.describe("") == storage.url

    def test_a_child_is_the_same_storage_below(self, storage):
        child = storage.child("sub")
        assert type(child) is type(storage)
        assert (child.zero_copy_reads, child.cheap_exists, child.create_settle_s) == (
            storage.zero_copy_reads, storage.cheap_exists, storage.create_settle_s)
        child.write("x", b"inner")
        child.write("d/y", b"deeper")
        assert storage.read("sub/x", max_size=ANY_SIZE) == b"inner"
        assert child.list("") == ["d", "x"]
        assert child.find("") == {"d/y": 6, "x": 5}
        assert child.describe("x") == storage.describe("sub/x")
        grandchild = child.child("d")
        assert grandchild.read("y", max_size=ANY_SIZE) == b"deeper"
        assert grandchild.describe("") == storage.describe("sub/d")
        with pytest.raises(CheckpointNotFoundError) as info:
            grandchild.read("missing", max_size=10)
        assert storage.describe("sub/d/missing") in str(info.value)

    # -- refusals -------------------------------------------------------------------------------------------------
    @only_where(has_permissions=True)
    def test_a_refusal_is_a_storage_error_with_errno(self, storage, deny):
        """Permissions: every operation that touches the object leaves as a StorageError with errno EACCES
        (or EPERM), naming the key (or its folder), the backend's PermissionError kept as the cause."""
        assert deny is not None, "a backend with permissions provides the deny fixture"
        storage.write("den/k", b"abc")
        calls = {
            "read": lambda: storage.read("den/k", max_size=10),
            "read max_size=0": lambda: storage.read("den/k", max_size=0),
            "read_into": lambda: storage.read_into("den/k", memoryview(bytearray(3))),
            "read_checked": lambda: storage.read_checked("den/k", max_size=10, check=bytes),
            "size": lambda: storage.size("den/k"),
            "write": lambda: storage.write("den/k", b"xyz"),
            "create": lambda: storage.create("den/new", b"new"),
            "delete": lambda: storage.delete("den/k"),
        }
        with deny("den"):
            for what, call in calls.items():
                with pytest.raises(StorageError) as info:
                    call()
                error = info.value
                assert error.errno in (errno.EACCES, errno.EPERM), (what, error, error.errno)
                assert "permission denied" in str(error) and storage.describe("den") in str(error), (what, error)
                assert isinstance(error.__cause__, PermissionError), (what, repr(error.__cause__))
        assert storage.read("den/k", max_size=10) == b"abc"
        assert not storage.exists("den/new")

    @only_where(has_permissions=True)
    def test_exists_is_an_error_when_refused(self, storage, deny):
        """``exists`` cannot tell: an error, not False (``Repository._exists_or_unknown`` keeps what may be
        needed when it cannot be told; a checkpoint must not vanish from a listing for want of a permission)."""
        assert deny is not None, "a backend with permissions provides the deny fixture"
        storage.write("den/k", b"abc")
        with deny("den"), pytest.raises(StorageError) as info:
            storage.exists("den/k")
        assert info.value.errno in (errno.EACCES, errno.EPERM)

    @only_where(has_permissions=True)
    def test_delete_many_is_an_error_when_refused(self, storage, deny):
        """gc counts what delete_many returned on as gone: a key the backend refused to delete must raise."""
        assert deny is not None, "a backend with permissions provides the deny fixture"
        storage.write("den/k", b"abc")
        storage.write("free/k", b"abc")
        with deny("den"), pytest.raises(StorageError) as info:
            storage.delete_many(["free/k", "den/k"])
        assert info.value.errno in (errno.EACCES, errno.EPERM)
        assert storage.read("den/k", max_size=10) == b"abc"

    @only_where(has_permissions=True)
    def test_every_failure_is_a_checkpoint_error(self, storage, deny):
        """Whatever the backend raises leaves as a CheckpointError: callers catch one hierarchy."""
        assert deny is not None, "a backend with permissions provides the deny fixture"
        storage.write("den/k", b"abc")
        with deny("den"):
            for call in (lambda: storage.list("den"), lambda: storage.find("den"),
                         lambda: storage.stage("den").publish("den/k2"), lambda: storage.delete_many(["den/k"])):
                with contextlib.suppress(CheckpointError):  # refused or allowed, by the backend's rules
                    call()


def _publish(storage: Storage, key: str) -> None:
    staged = storage.stage("")
    try:
        staged.write(b"replaced")
        staged.publish(key)
    finally:
        staged.discard()

