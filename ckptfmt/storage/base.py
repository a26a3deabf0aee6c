"""One storage layer over fsspec: the few primitives the format needs, on any URL.

``Storage`` works on every fsspec filesystem (memory://, s3://, ...). ``LocalStorage``
specialises it for local disks, where durability needs fsync and renames, and
reads can go straight into a tensor's memory.

Keys are '/'-separated paths relative to the storage root. Writes come in two
kinds: ``write`` (idempotent, for content-addressed chunks) and ``create``
(write-once: fails if the key exists, for commit records).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import random
import stat
import time
import uuid
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from ckptfmt.errors import CheckpointError, CheckpointNotFoundError, CorruptDataError, StorageError


def _file_kind(mode: int) -> str:
    """What a non-regular file is, for messages."""
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a file")


def _storage_error(exc: Exception, what: str) -> CheckpointError:
    """Translate a backend exception into the ckptfmt hierarchy."""
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, FileNotFoundError):
        return CheckpointNotFoundError(f"{what}: not found")
    if isinstance(exc, NotADirectoryError):  # a folder on the way is a file: nothing can be at this key
        return CheckpointNotFoundError(f"{what}: not found (a folder on its path is a file)")
    if isinstance(exc, PermissionError):
        return StorageError(f"{what}: permission denied")
    if isinstance(exc, OSError) and exc.strerror:  # "Not a directory", not "NotADirectoryError: [Errno 20] ..."
        return StorageError(f"{what}: {exc.strerror}")
    return StorageError(f"{what}: {exc}")


#: Tries of a conditional create that S3 answers with 409 ConditionalRequestConflict.
_CONFLICT_TRIES = 5
#: The backoff's jitter, apart from the global generator: a save must not move the training's RNG.
_JITTER = random.Random()


def _conditional_conflict(exc: Exception) -> bool:
    """Whether ``exc`` is S3's 409 ConditionalRequestConflict (s3fs chains botocore's error as the cause)."""
    response = getattr(exc.__cause__, "response", None) or getattr(exc, "response", None)
    return isinstance(response, dict) and response.get("Error", {}).get("Code") == "ConditionalRequestConflict"


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

    def child(self, key: str) -> "Storage":
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
        try:  # one ranged GET: one byte past the limit tells an oversized object apart
            data = self.fs.cat_file(self.path(key), start=0, end=max_size + 1)
        except Exception as exc:
            if isinstance(exc, OSError) and exc.errno == errno.EINVAL and self.size(key) == 0:
                return b""  # S3 answers any range of an empty object with 416
            raise _storage_error(exc, self.describe(key)) from None
        if len(data) > max_size:
            raise CorruptDataError(f"{self.describe(key)}: over the limit of {max_size} bytes")
        return data

    def read_into(self, key: str, buffer: memoryview) -> None:
        """Fill ``buffer`` with the bytes of ``key``, which must be exactly that long."""
        data = self.read(key, max_size=len(buffer))
        if len(data) != len(buffer):
            raise CorruptDataError(f"{self.describe(key)}: {len(data)} bytes, expected {len(buffer)}")
        buffer[:] = data

    def map(self, key: str, size: int) -> mmap.mmap | None:
        """A private (copy-on-write) memory map of ``key``, or None where mapping is not possible."""
        return None

    def size(self, key: str) -> int | None:
        """Size in bytes of ``key``, or None when there is no such object."""
        try:
            return int(self.fs.size(self.path(key)))
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise _storage_error(exc, self.describe(key)) from None

    def exists(self, key: str) -> bool:
        try:
            return bool(self.fs.exists(self.path(key)))
        except Exception as exc:
            raise _storage_error(exc, self.describe(key)) from None

    def list(self, key: str = "") -> list[str]:
        """Names of the entries directly under ``key`` (empty when it does not exist)."""
        try:
            self.fs.invalidate_cache(self.path(key))  # other processes may have written since
            entries = self.fs.ls(self.path(key), detail=False)
        except FileNotFoundError:
            return []
        except Exception as exc:
            raise _storage_error(exc, self.describe(key)) from None
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries})

    def find(self, key: str) -> dict[str, int]:
        """Every object below ``key`` (recursively), as {key relative to the storage: size}.

        One paginated listing on object stores (1,000 keys per request), a walk on local disks.
        """
        try:
            self.fs.invalidate_cache(self.path(key))
            found = self.fs.find(self.path(key), detail=True)
        except FileNotFoundError:
            return {}
        except Exception as exc:
            raise _storage_error(exc, self.describe(key)) from None
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
        try:
            self.fs.pipe_file(self.path(key), bytes(data))
        except Exception as exc:
            raise _storage_error(exc, self.describe(key)) from None

    def create(self, key: str, data: bytes) -> None:
        """Store ``data`` at ``key`` only if nothing is there; raises FileExistsError otherwise.

        On S3 this is a conditional PUT (``If-None-Match: *``), so two writers
        racing for one key cannot both succeed where the store honours it (see
        ``ObjectStorage`` for those that do not).
        """
        for attempt in range(_CONFLICT_TRIES):
            try:
                self.fs.pipe_file(self.path(key), bytes(data), mode="create")
                return
            except FileExistsError:
                raise
            except Exception as exc:
                # AWS answers 409 ConditionalRequestConflict when conditional writes to one
                # key overlap, and asks the client to retry; neither botocore nor s3fs does.
                # The retry gets 412 (the other write won: FileExistsError) or succeeds.
                if attempt + 1 == _CONFLICT_TRIES or not _conditional_conflict(exc):
                    raise _storage_error(exc, self.describe(key)) from None
            time.sleep(0.05 * 2**attempt * (1 + _JITTER.random()))

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self.path(key))
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise _storage_error(exc, self.describe(key)) from None

    def delete_many(self, keys: list[str]) -> None:
        """Delete ``keys`` (absent ones are no error); object stores batch them (1,000 per request)."""
        if not keys:
            return
        try:
            self.fs.rm([self.path(k) for k in keys])
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise _storage_error(exc, self.describe(keys[0])) from None

    def stage(self, directory: str) -> "Staged":
        """A new object written block by block, visible under no key until published.

        Here the blocks gather in memory and publishing is one PUT; local disks
        stream them to a temporary file in ``directory`` instead.
        """
        return Staged(self)

    def sync(self, keys: list[str]) -> None:
        """Make the named keys durable, contents and directory entries (object stores already are)."""

    def make_durable(self, keys: list[str]) -> None:
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


def _load_sync_file_range():
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int) -> None:
    """Ask the kernel to start writing the file's dirty pages now, without waiting for them.

    A save writes its chunks without fsync and syncs them all at the end; started
    early, the disk works while the save hashes and writes the next chunks, and
    the final fsyncs find little left to do. Only a hint: durability is still the fsync's.
    """
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def _write_all(fd: int, data) -> None:
    """os.write until every byte of ``data`` is written."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


class _StagedFile(Staged):
    """A temporary file ``.<basename>.tmp-<12 hex>`` (spec 11.2): fsynced, then renamed or linked onto its key.

    Every local write goes through one: a chunk streamed from memory that may
    still change (basename ``staged``, its key known only once it is hashed),
    a manifest, a commit record.
    """

    def __init__(self, storage: "LocalStorage", directory: str, basename: str = "staged"):
        self._storage = storage
        self._fd = -1
        try:
            storage.makedirs(directory)
            self.path = os.path.join(storage.path(directory), f".{basename}.tmp-{uuid.uuid4().hex[:12]}")
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except Exception as exc:
            raise _storage_error(exc, storage.describe(directory)) from None

    def write(self, block) -> None:
        try:
            _write_all(self._fd, block)
        except Exception as exc:
            self.discard()
            raise _storage_error(exc, self.path) from None

    def seal(self, durable: bool = True) -> str:
        """fsync (if ``durable``) and close the file; returns its path."""
        try:
            if durable:
                os.fsync(self._fd)
            else:
                _start_writeback(self._fd)
        except Exception as exc:
            self.discard()
            raise _storage_error(exc, self.path) from None
        os.close(self._fd)
        self._fd = -1
        return self.path

    def publish(self, key: str, *, durable: bool = True) -> None:
        self.seal(durable)
        try:
            self._storage.makedirs(os.path.dirname(key))
            os.replace(self.path, self._storage.path(key))
        except Exception as exc:
            self.discard()
            raise _storage_error(exc, self._storage.describe(key)) from None

    def discard(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class ObjectStorage(Storage):
    """Remote stores (S3 and other fsspec backends), whose conditional create cannot be taken on trust.

    Some S3-compatible stores ignore ``If-None-Match`` and moto checks then writes
    without a lock, so a commit record is read back after its create, and again
    ``create_settle_s`` later (``Repository.create_commit``, spec 11.3).
    """

    #: Seconds between the two read-backs of a commit record.
    create_settle_s: float | None = 0.25


class LocalStorage(Storage):
    """Local disks: temp file + fsync + rename, directory fsync, reads into caller memory."""

    zero_copy_reads = True
    cheap_exists = True

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str):
        super().__init__(fs, os.path.abspath(root), url)
        self._known_dirs: set[str] = set()
        #: Folders this storage created: their entries in their parents need an fsync too.
        self._new_dirs: set[str] = set()

    def _open_regular(self, key: str) -> tuple[int, int]:
        """An open descriptor on ``key`` and its size, refusing anything but a regular file.

        O_NONBLOCK: opening a FIFO must not wait for a writer; devices, FIFOs,
        sockets and folders are refused before a single byte is read.
        """
        where = self.describe(key)
        try:
            fd = os.open(self.path(key), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # a socket, or a FIFO-like device without a peer
                raise CorruptDataError(f"{where}: not a regular file (a socket or device)") from None
            raise _storage_error(exc, where) from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise CorruptDataError(f"{where}: not a regular file ({_file_kind(info.st_mode)})")
        return fd, info.st_size

    def read(self, key: str, *, max_size: int) -> bytes:
        fd, size = self._open_regular(key)
        where = self.describe(key)
        if size > max_size:
            os.close(fd)
            raise CorruptDataError(f"{where}: {size} bytes, over the limit of {max_size}")
        try:
            with open(fd, "rb") as f:
                # st_size is a hint, not a bound: read at most one byte past the limit.
                data = f.read(size + 1)
                if len(data) > size:
                    data += f.read(max_size + 1 - len(data))
        except Exception as exc:
            raise _storage_error(exc, where) from None
        if len(data) > max_size:
            raise CorruptDataError(f"{where}: over the limit of {max_size} bytes")
        return data

    def read_into(self, key: str, buffer: memoryview) -> None:
        fd, size = self._open_regular(key)
        where = self.describe(key)
        try:
            with open(fd, "rb", buffering=0) as f:
                if size != len(buffer):
                    raise CorruptDataError(f"{where}: {size} bytes, expected {len(buffer)}")
                view = buffer.cast("B")
                while view:
                    n = f.readinto(view)
                    if not n:
                        raise CorruptDataError(f"{where}: truncated while reading")
                    view = view[n:]
                if f.read(1):
                    raise CorruptDataError(f"{where}: longer than the {len(buffer)} bytes expected")
        except Exception as exc:
            raise _storage_error(exc, where) from None

    def map(self, key: str, size: int) -> mmap.mmap | None:
        if size == 0:
            return None
        fd, actual = self._open_regular(key)
        try:
            if actual != size:
                raise CorruptDataError(f"{self.describe(key)}: {actual} bytes, expected {size}")
            mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        except Exception as exc:
            raise _storage_error(exc, self.describe(key)) from None
        finally:
            os.close(fd)
        if hasattr(mapping, "madvise"):
            mapping.madvise(mmap.MADV_WILLNEED)  # start reading the whole file ahead of the hash
        return mapping

    def size(self, key: str) -> int | None:
        try:
            info = os.stat(self.path(key))
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise _storage_error(exc, self.describe(key)) from None
        if not stat.S_ISREG(info.st_mode):
            raise CorruptDataError(f"{self.describe(key)}: not a regular file ({_file_kind(info.st_mode)})")
        return info.st_size

    def exists(self, key: str) -> bool:
        return os.path.exists(self.path(key))

    def list(self, key: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self.path(key)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except Exception as exc:
            raise _storage_error(exc, self.describe(key)) from None

    def makedirs(self, key: str) -> None:
        path = self.path(key)
        if path in self._known_dirs:
            return
        missing = []
        probe = path
        while not os.path.isdir(probe):
            missing.append(probe)
            probe = os.path.dirname(probe)
        try:
            os.makedirs(path, exist_ok=True)
        except Exception as exc:
            raise _storage_error(exc, self.describe(key)) from None
        self._known_dirs.add(path)
        self._new_dirs.update(missing)

    def _staged(self, key: str, data) -> _StagedFile:
        """``data`` in a temporary file beside ``key``, not yet sealed."""
        directory, name = os.path.split(key)
        staged = _StagedFile(self, directory, name)
        staged.write(data)
        return staged

    def write(self, key: str, data, *, durable: bool = True) -> None:
        self._staged(key, data).publish(key, durable=durable)

    def create(self, key: str, data: bytes) -> None:
        staged = self._staged(key, data)
        tmp = staged.seal()
        try:
            os.link(tmp, self.path(key))  # atomic, and fails if the key exists
        except FileExistsError:
            raise
        except Exception as exc:
            raise _storage_error(exc, self.describe(key)) from None
        finally:
            staged.discard()
        self._sync_folders([key])  # the file itself was fsynced before it was linked

    def delete(self, key: str) -> None:
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise _storage_error(exc, self.describe(key)) from None

    def delete_many(self, keys: list[str]) -> None:
        for key in keys:
            self.delete(key)

    def remove_folder(self, key: str) -> None:
        """Remove the folder ``key`` if it is empty (object stores have no folders)."""
        try:
            os.rmdir(self.path(key))
        except (FileNotFoundError, OSError):
            pass

    def stage(self, directory: str) -> Staged:
        return _StagedFile(self, directory)

    def sync(self, keys: list[str]) -> None:
        """fsync each file (one written with ``durable=False`` reaches the disk now), then the folders
        that received entries, and the parents of folders this storage created."""
        for key in keys:
            self._fsync_file(key)
        self._sync_folders(keys)

    def _sync_folders(self, keys: list[str]) -> None:
        """fsync the folders holding ``keys`` and the parents of the folders this storage created."""
        directories = {os.path.dirname(self.path(k)) for k in keys}
        directories.update(os.path.dirname(d) for d in self._new_dirs)
        self._new_dirs.clear()
        self._fsync_folders(directories)

    def _fsync_file(self, key: str) -> None:
        try:
            fd = os.open(self.path(key), os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except Exception as exc:
            raise _storage_error(exc, self.describe(key)) from None

    def make_durable(self, keys: list[str]) -> None:
        """fsync each file, then every folder from its own up to the root: a killed save may have
        died before making any of these entries durable, even folders it created."""
        folders = set()
        for key in keys:
            self._fsync_file(key)
            folder = os.path.dirname(self.path(key))
            folders.add(folder)
            while len(folder) > len(self.root):
                folder = os.path.dirname(folder)
                folders.add(folder)
        self._fsync_folders(folders)

    @staticmethod
    def _fsync_folders(folders) -> None:
        """fsync folders, deepest first (their entries in their parents come next)."""
        for directory in sorted(folders, key=len, reverse=True):
            try:
                fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            except OSError as exc:  # some filesystems cannot fsync directories
                if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
                    raise _storage_error(exc, directory) from None
            finally:
                os.close(fd)

    def child(self, key: str) -> "LocalStorage":
        return LocalStorage(self.fs, self.path(key), self.describe(key))


#: botocore client settings for s3:// storages; each key of the caller's
#: ``storage_options["config_kwargs"]`` replaces the one here.
S3_CONFIG_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 10,
    "read_timeout": 30,
    "retries": {"mode": "standard", "total_max_attempts": 6},
}
#: The AWS environment variables that take precedence over the ``retries`` default, key by key.
_RETRIES_ENVIRONMENT = {"mode": "AWS_RETRY_MODE", "total_max_attempts": "AWS_MAX_ATTEMPTS"}
#: Tries of s3fs's own retry loop (its default is 5; it is a class attribute, not an option).
S3FS_TRIES = 2


def _s3_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` over ckptfmt's S3 client defaults.

    Retries live in botocore ("standard" mode: 500/502/503/504, SlowDown and other
    throttling, connection errors and timeouts, with jittered exponential backoff
    and a retry quota that stops retry storms), 6 attempts in all: a save makes
    thousands of requests and one failed request fails it. Timeouts make every
    attempt end: 10 s to connect, 30 s without a byte of the response (aiohttp
    starts this clock once the request body is sent, so large uploads do not
    trip it). s3fs wraps every call in its own retry loop, and whole-object reads
    in a second one, around botocore's: at its default of 5 that multiplies the
    attempts by 25. Two tries keep one s3fs retry for what botocore never sees,
    an error while reading a GET body (e.g. a truncated body). Worst case per
    request, with every attempt stalled: 2 (4 for whole-object reads) x 6 x 40 s
    plus backoff; in practice botocore's retry quota cuts an outage much shorter.
    ``AWS_RETRY_MODE`` and ``AWS_MAX_ATTEMPTS`` in the environment keep precedence
    (botocore reads them for the keys missing from ``retries``).
    """
    retries = {key: value for key, value in S3_CONFIG_DEFAULTS["retries"].items()
               if _RETRIES_ENVIRONMENT[key] not in os.environ}
    defaults = {**S3_CONFIG_DEFAULTS, "retries": retries}
    return {**options, "config_kwargs": {**defaults, **(options.get("config_kwargs") or {})}}


def open_storage(url: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> Storage:
    """The storage for a local path or fsspec URL (``s3://``, ``memory://``, ``file://``).

    S3 endpoint and credentials come from ``storage_options`` or, as in a user's
    shell, from the standard AWS environment variables (``AWS_ENDPOINT_URL``, ...).
    s3:// storages get bounded timeouts and retries by default (``_s3_options``).
    """
    url = os.fspath(url)
    options = dict(storage_options or {})
    s3 = fsspec.core.split_protocol(url)[0] in ("s3", "s3a")
    if s3:
        options = _s3_options(options)
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        raise StorageError(f"{url}: missing backend ({exc}); for s3:// install ckptfmt[s3]") from None
    except Exception as exc:
        raise _storage_error(exc, url) from None
    if isinstance(fs, LocalFileSystem):
        return LocalStorage(fs, root, url)
    if isinstance(fs, MemoryFileSystem):
        return Storage(fs, root, url)
    if s3:
        fs.retries = S3FS_TRIES
        _fail_fast_when_refused(fs)
    return ObjectStorage(fs, root, url)


#: Attempts at a request whose connection the endpoint refuses (nothing listens there).
REFUSED_ATTEMPTS = 2


def _fail_fast_when_refused(fs) -> None:
    """Stop botocore's retries once an endpoint has refused the connection twice.

    A refused connection (no server at that address: a wrong ``AWS_ENDPOINT_URL``, a
    local server not started) does not heal within a backoff's seconds, and 6
    attempts took 11 s per request, 22-30 s per command. Timeouts, resets and 5xx
    answers keep every retry. Registered once per client (s3fs caches filesystems).
    """
    client = fs.connect() if getattr(fs, "_s3", None) is None else fs.s3
    if getattr(client, "_ckptfmt_fail_fast", False):
        return
    client.meta.events.register_first("needs-retry.s3", _raise_when_refused)
    client._ckptfmt_fail_fast = True


def _raise_when_refused(attempts: int, caught_exception: Exception | None = None, **_: Any) -> None:
    if caught_exception is not None and attempts >= REFUSED_ATTEMPTS and _refused(caught_exception):
        raise caught_exception


def _refused(exc: BaseException) -> bool:
    """Whether ``exc`` (botocore's error, aiohttp's inside it) comes from a refused connection."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ConnectionRefusedError):
            return True
        inner = getattr(exc, "kwargs", {}).get("error") if isinstance(getattr(exc, "kwargs", None), dict) else None
        exc = inner or getattr(exc, "os_error", None) or exc.__cause__ or exc.__context__
    return False


def in_process_memory(url: str | os.PathLike) -> bool:
    """Whether ``url`` names storage that lives in this process's memory (memory://), out of another's reach."""
    return fsspec.core.split_protocol(os.fspath(url))[0] == "memory"
