"""The storage interface: the few primitives the format needs, on any fsspec filesystem.

``Storage`` works on every fsspec filesystem as it is (in-process memory://
uses it directly); ``storage/local.py`` specialises it for local disks, where
durability needs fsync and renames and reads can go straight into a tensor's
memory, and ``storage/object_store.py`` for S3 and other remote stores.
``storage/factory.py`` picks one for a URL.

Keys are '/'-separated paths relative to the storage root. Writes come in two
kinds: ``write`` (idempotent, for content-addressed chunks) and ``create``
(write-once: fails if the key exists, for commit records).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import mmap
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

import fsspec

from ckptfmt.errors import CheckpointNotFoundError, CorruptDataError
from ckptfmt.storage.errors import backend_errors

T = TypeVar("T")

#: Serialises ``Storage.create`` within this process: fsspec's create on memory:// is check-then-write.
_CREATE_LOCK = threading.Lock()


class Storage:
    """Key/value access to a folder or prefix on any fsspec filesystem."""

    #: Whether ``read_into`` reads straight into caller memory without a copy.
    zero_copy_reads = False
    #: Whether ``exists`` is cheap (a stat) rather than a network round trip.
    cheap_exists = False
    #: None where ``create`` is trusted to be write-once (local link(), in-process memory).
    create_settle_s: float | None = None

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str):
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url.rstrip("/")

    def path(self, key: str) -> str:
        """The backend path of ``key``."""
        return f"{self.root}/{key}" if key else self.root

    def describe(self, key: str) -> str:
        """The user-facing URL of ``key``, for messages."""
        return f"{self.url}/{key}" if key else self.url

    def child(self, key: str) -> Storage:
        """A storage rooted at ``key`` below this one, on the same filesystem."""
        return type(self)(self.fs, self.path(key), self.describe(key))

    # -- reads --------------------------------------------------------------
    def read(self, key: str, *, max_size: int) -> bytes:
        """All bytes of ``key``, refusing objects larger than ``max_size`` (0 means: must be empty).

        Every read is bounded, whatever the object or a manifest claims.
        """
        if max_size == 0:  # a zero-length range is an error on S3: ask for the size instead
            size = self.size(key)
            if size is None:
                raise CheckpointNotFoundError(f"{self.describe(key)}: not found")
            if size:
                raise CorruptDataError(f"{self.describe(key)}: {size} bytes, over the limit of 0")
            return b""
        with backend_errors(self.describe(key)):
            try:  # one ranged GET: one byte past the limit tells an oversized object apart
                data = self.fs.cat_file(self.path(key), start=0, end=max_size + 1)
            except OSError as exc:
                if exc.errno == errno.EINVAL and self.size(key) == 0:
                    return b""  # S3 answers any range of an empty object with 416
                raise
        if len(data) > max_size:
            raise CorruptDataError(f"{self.describe(key)}: over the limit of {max_size} bytes")
        return data

    def read_checked(self, key: str, *, max_size: int, check: Callable[[bytes], T]) -> T:
        """``check(data)`` of the bytes of ``key``: where bytes can be damaged on their way (object
        stores), a failed check reads them again; here the store's bytes are the bytes read."""
        return check(self.read(key, max_size=max_size))

    def read_into(self, key: str, buffer: memoryview) -> None:
        """Fill ``buffer`` with the bytes of ``key``, which must be exactly that long."""
        data = self.read(key, max_size=len(buffer))
        if len(data) != len(buffer):
            raise CorruptDataError(f"{self.describe(key)}: {len(data)} bytes, expected {len(buffer)}")
        buffer[:] = data

    def map(self, key: str, size: int) -> mmap.mmap | None:
        """A private (copy-on-write) memory map of ``key``, or None where mapping is not possible."""
        return None

    def read_windows(self, key: str, starts: Sequence[int], length: int) -> bytes | None:
        """The ``length`` bytes of ``key`` at each of ``starts``, joined, where a few small reads are
        cheap (a local file: without touching a map of it); else None."""
        return None

    def size(self, key: str) -> int | None:
        """Size in bytes of ``key``, or None when there is no such object."""
        with backend_errors(self.describe(key)):
            try:
                return int(self.fs.size(self.path(key)))
            except FileNotFoundError:
                return None

    def exists(self, key: str) -> bool:
        with backend_errors(self.describe(key)):
            return bool(self.fs.exists(self.path(key)))

    def missing_container(self) -> str | None:
        """Why nothing at all can be at this storage's root, for messages ("the bucket ... does not
        exist"), or None where it may simply be empty."""
        return None

    def list(self, key: str = "") -> list[str]:
        """Names of the entries directly under ``key`` (empty when it does not exist)."""
        with backend_errors(self.describe(key)):
            try:
                self.fs.invalidate_cache(self.path(key))  # other processes may have written since
                entries = self.fs.ls(self.path(key), detail=False)
                self.fs.invalidate_cache(self.path(key))  # s3fs would answer exists and size from it, gone stale
            except FileNotFoundError:
                return []
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != self.path(key)})

    def find(self, key: str) -> dict[str, int]:
        """Every object below ``key`` (recursively), as {key relative to the storage: size}.

        One paginated listing on object stores (1,000 keys per request), a walk on local disks.
        """
        try:
            with backend_errors(self.describe(key)):
                try:
                    self.fs.invalidate_cache(self.path(key))
                    found = self.fs.find(self.path(key), detail=True)
                except FileNotFoundError:
                    return {}
        finally:
            self._forget_listings(self.path(key))
        start = len(self.root) + 1
        return {path[start:]: int(info.get("size") or 0) for path, info in found.items()
                if info.get("type") != "directory"}

    def _forget_listings(self, path: str) -> None:
        """Drop cached listings of ``path`` and below: s3fs answers ``exists`` from them, blind to
        objects written since (``invalidate_cache`` forgets the path and its parents only)."""
        self.fs.invalidate_cache(path)
        cache = getattr(self.fs, "dircache", None)
        if cache:
            prefix = self.fs._strip_protocol(path).rstrip("/") + "/"
            for cached in [k for k in list(cache) if k.startswith(prefix)]:
                cache.pop(cached, None)

    # -- writes -------------------------------------------------------------
    def write(self, key: str, data, *, durable: bool = True) -> None:
        """Store ``data`` at ``key``, replacing any object there, atomically for readers.

        ``durable=False``: on a local disk the file may reach the disk later; ``sync``
        makes it durable (a save writes its chunks so, and syncs them all at once).
        """
        with backend_errors(self.describe(key)):
            self.fs.pipe_file(self.path(key), bytes(data))

    def create(self, key: str, data: bytes) -> None:
        """Store ``data`` at ``key`` only if nothing is there; raises FileExistsError otherwise.

        On S3 this is a conditional PUT (``If-None-Match: *``), so two writers
        racing for one key cannot both succeed where the store honours it (see
        ``ObjectStorage`` for those that do not).
        """
        # memory:// (the filesystem this class serves as it is) checks, then writes: two threads could both
        # win, yet create_settle_s is None. memory:// lives in this process, so a lock makes it write-once.
        with backend_errors(self.describe(key), passing=(FileExistsError,)), _CREATE_LOCK:
            self.fs.pipe_file(self.path(key), bytes(data), mode="create")

    def refuse_links(self, key: str, checked: builtins.set[str] | None = None) -> None:
        """Raise UnsafePathError where deleting or replacing ``key`` would act through a symbolic link
        (local disks); object stores and memory:// have none."""

    def delete(self, key: str) -> None:
        with backend_errors(self.describe(key)), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(key))

    def delete_many(self, keys: builtins.list[str]) -> None:
        """Delete exactly ``keys``, taken literally (absent ones are no error); S3 batches them (1,000 per request)."""
        # One rm_file per key, not fs.rm: rm expands glob characters (a root ``runs[12]`` would delete
        # ``runs1/k``), and memory://'s rm stops at the first absent key. ObjectStorage batches S3's.
        for key in keys:
            with backend_errors(self.describe(key)), contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.path(key))

    def stage(self, directory: str) -> Staged:
        """A new object written block by block, visible under no key until published.

        Here the blocks gather in memory and publishing is one PUT; local disks
        stream them to a temporary file in ``directory`` instead.
        """
        return Staged(self)

    def sync(self, keys: builtins.list[str]) -> None:
        """Make the named keys durable, contents and directory entries (object stores already are)."""

    def make_durable(self, keys: builtins.list[str]) -> None:
        """Make objects this process found rather than wrote (a killed save's) as durable as its own."""

    def makedirs(self, key: str) -> None:
        """Create the folder ``key`` where folders exist (object stores have none)."""

    def remove_folder(self, key: str) -> None:
        """Remove the folder ``key`` if it is empty, where folders exist (object stores have none)."""


class Staged:
    """An object being written that no key names yet: published under its key once complete, or discarded."""

    def __init__(self, storage: Storage):
        self._storage = storage
        self._buffer = bytearray()

    def write(self, block) -> None:
        self._buffer += block

    def publish(self, key: str, *, durable: bool = True) -> None:
        self._storage.write(key, self._buffer, durable=durable)
        self._buffer = bytearray()

    def discard(self) -> None:
        self._buffer = bytearray()
