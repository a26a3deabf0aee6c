"""Local disks: temporary file, fsync and rename; folder fsyncs; reads straight into caller memory."""

from __future__ import annotations

import builtins
import contextlib
import errno
import mmap
import os
import stat
import uuid
from collections.abc import Sequence

import fsspec

from ckptfmt._platform import start_writeback
from ckptfmt.errors import CheckpointError, CorruptDataError, UnsafePathError
from ckptfmt.storage.base import Staged, Storage
from ckptfmt.storage.errors import backend_errors, translate_error


def _file_kind(mode: int) -> str:
    """What a non-regular file is, for messages."""
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a file")


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

    def __init__(self, storage: LocalStorage, directory: str, basename: str = "staged"):
        self._storage = storage
        self._fd = -1
        with backend_errors(storage.describe(directory)):
            storage.makedirs(directory)
            self.path = os.path.join(storage.path(directory), f".{basename}.tmp-{uuid.uuid4().hex[:12]}")
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)

    def write(self, block) -> None:
        try:
            with backend_errors(self.path):
                _write_all(self._fd, block)
        except CheckpointError:
            self.discard()
            raise

    def seal(self, durable: bool = True) -> str:
        """fsync (if ``durable``) and close the file; returns its path."""
        try:
            with backend_errors(self.path):
                if durable:
                    os.fsync(self._fd)
                else:
                    start_writeback(self._fd)
        except CheckpointError:
            self.discard()
            raise
        os.close(self._fd)
        self._fd = -1
        return self.path

    def publish(self, key: str, *, durable: bool = True) -> None:
        self.seal(durable)
        try:
            with backend_errors(self._storage.describe(key)):
                self._storage.makedirs(os.path.dirname(key))
                self._storage.refuse_links(key)
                os.replace(self.path, self._storage.path(key))
        except CheckpointError:
            self.discard()
            raise

    def discard(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


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
        fd = self._open(key)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise self._not_regular(key, info.st_mode)
        return fd, info.st_size

    def _open(self, key: str) -> int:
        """A read-only, non-blocking descriptor on ``key``, whatever it is (a socket refused)."""
        try:  # no context manager or message made unless it fails: once for each chunk a load maps
            return os.open(self.path(key), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # a socket, or a FIFO-like device without a peer
                raise CorruptDataError(f"{self.describe(key)}: not a regular file (a socket or device)") from None
            raise translate_error(exc, self.describe(key)) from exc

    def _not_regular(self, key: str, mode: int) -> CorruptDataError:
        return CorruptDataError(f"{self.describe(key)}: not a regular file ({_file_kind(mode)})")

    def read(self, key: str, *, max_size: int) -> bytes:
        fd, size = self._open_regular(key)
        where = self.describe(key)
        if size > max_size:
            os.close(fd)
            raise CorruptDataError(f"{where}: {size} bytes, over the limit of {max_size}")
        with backend_errors(where), open(fd, "rb") as f:
            # st_size is a hint, not a bound: read at most one byte past the limit.
            data = f.read(size + 1)
            if len(data) > size:
                data += f.read(max_size + 1 - len(data))
        if len(data) > max_size:
            raise CorruptDataError(f"{where}: over the limit of {max_size} bytes")
        return data

    def read_into(self, key: str, buffer: memoryview) -> None:
        fd, size = self._open_regular(key)
        where = self.describe(key)
        with backend_errors(where), open(fd, "rb", buffering=0) as f:
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

    def map(self, key: str, size: int) -> mmap.mmap | None:
        if size == 0:
            return None
        fd = self._open(key)
        try:
            # No fstat of our own (one syscall of each chunk a load maps): a length of 0 maps a regular file
            # whole and fails on anything else (CPython's mmap maps st_size of regular files only, and the
            # kernel refuses a map of no length); the file's kind is looked up when it fails.
            mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as exc:  # ValueError: an empty file
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise self._not_regular(key, info.st_mode) from None
            if info.st_size != size:
                raise CorruptDataError(f"{self.describe(key)}: {info.st_size} bytes, expected {size}") from None
            raise translate_error(exc, self.describe(key)) from exc
        finally:
            os.close(fd)
        actual = len(mapping)
        if actual != size:
            mapping.close()
            raise CorruptDataError(f"{self.describe(key)}: {actual} bytes, expected {size}")
        return mapping

    def read_windows(self, key: str, starts: Sequence[int], length: int) -> bytes:
        fd, size = self._open_regular(key)
        where = self.describe(key)
        try:
            with backend_errors(where):
                windows = [os.pread(fd, length, start) for start in starts]
        finally:
            os.close(fd)
        if any(len(window) != length for window in windows):
            raise CorruptDataError(f"{where}: {size} bytes, shorter than the windows read")
        return b"".join(windows)

    def size(self, key: str) -> int | None:
        with backend_errors(self.describe(key)):
            try:
                info = os.stat(self.path(key))
            except (FileNotFoundError, NotADirectoryError):  # below a file too: nothing is there
                return None
        if not stat.S_ISREG(info.st_mode):
            raise CorruptDataError(f"{self.describe(key)}: not a regular file ({_file_kind(info.st_mode)})")
        return info.st_size

    def exists(self, key: str) -> bool:
        # os.stat, not os.path.exists: that answers False when a folder cannot be searched (EACCES),
        # and a checkpoint must not vanish for want of a permission. Only "nothing there" is False.
        with backend_errors(self.describe(key)):
            try:
                os.stat(self.path(key))
            except (FileNotFoundError, NotADirectoryError):  # below a file too: nothing is there
                return False
        return True

    def list(self, key: str = "") -> list[str]:
        with backend_errors(self.describe(key)):
            try:
                return sorted(os.listdir(self.path(key)))
            except (FileNotFoundError, NotADirectoryError):
                return []

    def makedirs(self, key: str) -> None:
        path = self.path(key)
        if path in self._known_dirs:
            return
        missing = []
        probe = path
        while not os.path.isdir(probe):
            missing.append(probe)
            probe = os.path.dirname(probe)
        with backend_errors(self.describe(key)):
            os.makedirs(path, exist_ok=True)
        self._known_dirs.add(path)
        self._new_dirs.update(missing)

    def _staged(self, key: str, data) -> _StagedFile:
        """``data`` in a temporary file beside ``key``, not yet sealed."""
        self.refuse_links(key)  # before the temporary file goes into a linked folder
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
            with backend_errors(self.describe(key), passing=(FileExistsError,)):
                os.link(tmp, self.path(key))  # atomic, and fails if the key exists
        finally:
            staged.discard()
        self._sync_folders([key])  # the file itself was fsynced before it was linked

    def refuse_links(self, key: str, checked: set[str] | None = None) -> None:
        """Raise UnsafePathError if ``key`` or a folder between the root and it is a symbolic link.

        Deleting or replacing through a link would act outside this repository (a link
        ``REPO/victim`` to another repository's checkpoint: its commit record, manifest,
        a user's notes). The root may be reached through links: it is the repository.
        ``checked``: folders already found to be no links, for a batch of keys.
        """
        path = self.root
        for part in key.split("/"):
            path = os.path.join(path, part)
            if checked is not None and path in checked:
                continue
            if os.path.islink(path):
                raise UnsafePathError(
                    f"{self.describe(key)}: refused, {path} is a symbolic link (to {os.readlink(path)}); ckptfmt "
                    "never deletes or overwrites through a link, which would act outside the repository's folder")
            if checked is not None and path != self.path(key):
                checked.add(path)

    def delete(self, key: str) -> None:
        self.refuse_links(key)
        with backend_errors(self.describe(key)), contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(key))

    def delete_many(self, keys: builtins.list[str]) -> None:
        checked: set[str] = set()
        for key in keys:
            self.refuse_links(key, checked)
            with backend_errors(self.describe(key)), contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(key))

    def remove_folder(self, key: str) -> None:
        """Remove the folder ``key`` if it is empty (object stores have no folders)."""
        self.refuse_links(key)
        try:
            os.rmdir(self.path(key))
        except (FileNotFoundError, OSError):
            pass

    def stage(self, directory: str) -> Staged:
        return _StagedFile(self, directory)

    def sync(self, keys: builtins.list[str]) -> None:
        """fsync each file (one written with ``durable=False`` reaches the disk now), then the folders
        that received entries, and the parents of folders this storage created."""
        for key in keys:
            self._fsync_file(key)
        self._sync_folders(keys)

    def _sync_folders(self, keys: builtins.list[str]) -> None:
        """fsync the folders holding ``keys`` and the parents of the folders this storage created."""
        directories = {os.path.dirname(self.path(k)) for k in keys}
        directories.update(os.path.dirname(d) for d in self._new_dirs)
        self._new_dirs.clear()
        self._fsync_folders(directories)

    def _fsync_file(self, key: str) -> None:
        with backend_errors(self.describe(key)):
            fd = os.open(self.path(key), os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def make_durable(self, keys: builtins.list[str]) -> None:
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
                with backend_errors(directory):
                    try:
                        os.fsync(fd)
                    except OSError as exc:  # some filesystems cannot fsync directories
                        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
                            raise
            finally:
                os.close(fd)

    def child(self, key: str) -> LocalStorage:
        return LocalStorage(self.fs, self.path(key), self.describe(key))
