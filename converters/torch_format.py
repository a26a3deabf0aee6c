"""Read torch.save files without running their pickles, for ``ckptfmt import``.

Both formats torch.save writes are read directly:

- **zip** (torch >= 1.6): ``ARCHIVE/data.pkl`` (the pickle, storages as persistent ids
  ``('storage', storage class, key, location, numel)``), ``ARCHIVE/data/KEY`` (each storage's
  raw bytes, stored uncompressed), ``ARCHIVE/byteorder`` and ``ARCHIVE/version``. Storage
  records are memory-mapped (copy-on-write, so the tensors are writable but the file never
  changes) and their zip CRC-32 checked on threads: before ``read`` returns, or, through
  ``read_deferred``, while ``import_checkpoint`` saves (before it commits).
- **legacy** (``_use_new_zipfile_serialization=False``): pickles of the magic number, the
  protocol version (1001) and sys_info, then the main pickle (persistent ids
  ``('storage', class, key, location, numel, view_metadata)``), then the sorted storage
  keys, then for each key an int64 element count and the raw bytes. Storages are located
  by offset and memory-mapped; nothing but the pickles is read up front.

Pickles go through ``converters.pickles.RestrictedUnpickler``: nothing is imported or
called; unknown objects become ``ckptfmt.OpaqueObject``. Tensors that viewed one storage
come back as views of one mapped storage (offsets and strides kept); ckptfmt then stores
each tensor's own bytes. torch does not record its version in either format: ``versions``
holds the container ("zip" or "legacy") and the archive's ``version`` record or the
legacy protocol version.
"""

from __future__ import annotations

import io
import mmap
import os
import struct
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptfmt.converters.importer import Imported, note_opaque_and_step
from ckptfmt.converters.pickles import (
    MAX_PICKLE_BYTES,
    BudgetReader,
    PickleError,
    RestrictedUnpickler,
    Storage,
    StorageType,
    to_value_tree,
)
from ckptfmt.errors import CheckpointError, CheckpointNotFoundError

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
_ZIP_MAGIC = b"PK\x03\x04"


def detect(path: str) -> bool:
    """True for a torch.save zip archive (with a data.pkl) or a legacy torch.save file."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return False
    if head.startswith(_ZIP_MAGIC):
        try:
            with zipfile.ZipFile(path) as zf:
                return any(n.endswith("data.pkl") and n.count("/") == 1 for n in zf.namelist())
        except (zipfile.BadZipFile, OSError, ValueError):
            return False
    # legacy: a pickle (protocol 2+, maybe framed) of the magic number, a LONG1 of 10 bytes
    return head[:1] == b"\x80" and b"\x8a\x0a" + LEGACY_MAGIC.to_bytes(10, "little") in head[:32]


def read(path: str, *, drop_tensor_attributes: bool = False) -> Imported:
    """Read a torch.save file as an import, every check done (raises CheckpointError naming the file).

    ``drop_tensor_attributes``: tensors pickled with Python attributes come back as plain
    tensors over the mapped file (see ``pickles.attributed_tensor``), not as opaque copies.
    """
    imported = _read(path, _WAITED_CRC_THREADS, drop_tensor_attributes)
    if imported.pending is not None:
        imported.pending.wait()
        imported.pending = None
    return imported


def read_deferred(path: str) -> Imported:
    """``read``, but with the storages' CRC-32 checks still running in ``pending``.

    ``import_checkpoint`` waits for them just before its save commits, so the
    check and the save read the (cold) file once, together.
    """
    return _read(path, _BACKGROUND_CRC_THREADS)


def _read(path: str, crc_threads: int, drop_tensor_attributes: bool = False) -> Imported:
    """The import, its CRC-32 checks started on ``crc_threads`` threads (in ``pending``)."""
    path = os.fspath(path)
    buffer = _map(path)
    notes: set[str] = set()
    check = None
    try:
        if bytes(buffer[:4]) == _ZIP_MAGIC:
            obj, versions, stored = _read_zip(buffer, path, path, 0, notes)
            check = _CrcCheck(stored, path, crc_threads)
        else:
            obj, versions = _read_legacy(buffer, path, 0, notes)
        converted = to_value_tree(obj, path, notes, drop_tensor_attributes=drop_tensor_attributes)
    except BaseException as exc:
        if check is not None:
            check.cancel()
        if isinstance(exc, PickleError):
            raise CheckpointError(f"{path}: {exc}") from None
        raise
    imported = Imported(state=converted.value, kind="torch", versions=versions,
                        opaque=converted.opaque, notes=list(converted.notes), pending=check)
    note_opaque_and_step(imported, converted.opaque)
    return imported


def load_object(data: bytes | memoryview, where: str, *, depth: int = 0, notes: set | None = None) -> Any:
    """The raw unpickled object of a torch file held in memory (torch.storage._load_from_bytes).

    A writable memoryview (a slice of a copy-on-write file mapping) is used in place, so
    its tensors stay views of the file; other bytes are copied once, to be writable.
    """
    notes = notes if notes is not None else set()
    view = memoryview(data).cast("B")
    buffer = view if not view.readonly else memoryview(bytearray(view))
    if bytes(buffer[:4]) == _ZIP_MAGIC:
        obj, _, stored = _read_zip(buffer, _ViewFile(buffer), where, depth, notes)
        _CrcCheck(stored, where, _WAITED_CRC_THREADS).wait()
        return obj
    return _read_legacy(buffer, where, depth, notes)[0]


class _ViewFile(io.RawIOBase):
    """A seekable read-only file over a memoryview, for zipfile (io.BytesIO would copy the bytes)."""

    def __init__(self, view: memoryview):
        super().__init__()
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, target) -> int:
        count = max(0, min(len(target), len(self._view) - self._pos))
        target[:count] = self._view[self._pos:self._pos + count]
        self._pos += count
        return count

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos


def _map(path: str) -> memoryview:
    """The file, memory-mapped copy-on-write (writable views, the file itself never changes)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise CheckpointError(f"{path}: empty file, not a torch.save file")
            return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read ({exc})") from exc


class _Storages:
    """Persistent-id handler: one Storage per key, checked against the file's records."""

    def __init__(self, where: str, resolve):
        self.where = where
        self.resolve = resolve  # key, Storage -> None (binds or schedules the bytes)
        self.by_key: dict[str, Storage] = {}
        self.locations: set[str] = set()

    def __call__(self, pid: Any) -> Storage:
        if type(pid) is not tuple or not pid or pid[0] not in ("storage", b"storage"):
            raise PickleError(f"unsupported persistent id {str(pid)[:80]}")
        if len(pid) == 6 and pid[5] is not None:
            raise PickleError("storage views of pre-0.4 torch files are not supported")
        if len(pid) not in (5, 6):
            raise PickleError(f"malformed storage id {str(pid)[:80]}")
        _, storage_type, key, location, numel = pid[:5]
        if not isinstance(storage_type, StorageType):
            raise PickleError(f"storage of unsupported type {storage_type!r}")
        if type(key) is not str or type(location) is not str:
            raise PickleError(f"malformed storage id {str(pid)[:80]}")
        storage = self.by_key.get(key)
        if storage is not None:
            if storage.dtype != storage_type.dtype or storage.numel != numel:
                raise PickleError(f"storage {key!r} is described two different ways")
            return storage
        storage = Storage(key, storage_type.dtype, numel, location)
        self.by_key[key] = storage
        self.locations.add(location)
        self.resolve(key, storage)
        return storage


def _note_locations(storages: _Storages, notes: set) -> None:
    moved = sorted(loc for loc in storages.locations if loc != "cpu")
    if moved:
        notes.add(f"storages saved on {', '.join(moved)} were imported to CPU")


def _read_zip(buffer: memoryview, file, where: str, depth: int,
              notes: set) -> tuple[Any, dict, list[tuple[Storage, zipfile.ZipInfo]]]:
    """The archive's object, its versions, and its storages with their records (CRC-32s unchecked)."""
    try:
        zf = zipfile.ZipFile(file)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise CheckpointError(f"{where}: not a readable zip archive, truncated or damaged ({exc})") from None
    with zf:
        infos = {info.filename: info for info in zf.infolist()}
        pickles = [name for name in infos if name.endswith("/data.pkl") and name.count("/") == 1]
        if len(pickles) != 1:
            raise CheckpointError(f"{where}: zip archive without exactly one ARCHIVE/data.pkl: not a torch.save file")
        prefix = pickles[0][: -len("data.pkl")]

        def record(name: str) -> bytes | None:
            info = infos.get(prefix + name)
            if info is None:
                return None
            if info.file_size > MAX_PICKLE_BYTES:
                raise CheckpointError(f"{where}: record {prefix + name} is over {MAX_PICKLE_BYTES} bytes")
            try:
                return zf.read(info)
            except (zipfile.BadZipFile, OSError, ValueError, EOFError, zlib.error) as exc:
                raise CheckpointError(f"{where}: record {prefix + name} is damaged ({exc})") from None

        byteorder = record("byteorder")
        if byteorder is not None and byteorder.strip() not in (b"little",):
            raise CheckpointError(f"{where}: byte order {byteorder.strip().decode(errors='replace')!r}: "
                                  "only little-endian files can be imported")
        version = record("version")
        versions = {"torch.save": "zip"}
        if version is not None:
            versions["torch.save archive version"] = version.decode("ascii", "replace").strip()
        for name, label in ((".data/version", "data version"), (".format_version", "format version")):
            found = record(name)
            if found is not None:
                versions[f"torch.save {label}"] = found.decode("ascii", "replace").strip()
        data_pkl = record("data.pkl")
        used: list[tuple[Storage, zipfile.ZipInfo]] = []

        def resolve(key: str, storage: Storage) -> None:
            name = f"{prefix}data/{key}"
            info = infos.get(name)
            if info is None:
                raise PickleError(f"storage record {name} is missing")
            if info.file_size != storage.nbytes:
                raise PickleError(f"storage record {name} holds {info.file_size} bytes, "
                                  f"the pickle says {storage.nbytes} ({storage.numel} x {storage.dtype})")
            storage.bind(_member_view(buffer, zf, info, where))
            used.append((storage, info))

        storages = _Storages(where, resolve)
        try:
            obj = RestrictedUnpickler(BudgetReader(data_pkl), persistent_load=storages,
                                      depth=depth, notes=notes, torch_files=load_object).load_checked()
        except PickleError as exc:
            raise CheckpointError(f"{where}: {prefix}data.pkl: {exc}") from None
        _note_locations(storages, notes)
    return obj, versions, used


def _member_view(buffer: memoryview, zf: zipfile.ZipFile, info: zipfile.ZipInfo, where: str) -> memoryview:
    """A zero-copy view of a stored member's bytes (compressed members are read into memory)."""
    if info.compress_type != zipfile.ZIP_STORED:
        try:
            return memoryview(bytearray(zf.read(info)))
        except (zipfile.BadZipFile, OSError, ValueError, zlib.error) as exc:
            raise CheckpointError(f"{where}: record {info.filename} is damaged ({exc})") from None
    start = info.header_offset
    header = bytes(buffer[start:start + 30])
    if len(header) < 30 or header[:4] != _ZIP_MAGIC:
        raise CheckpointError(f"{where}: record {info.filename}: bad local header")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    begin = start + 30 + name_len + extra_len
    end = begin + info.file_size
    if end > len(buffer):
        raise CheckpointError(f"{where}: record {info.filename} runs past the end of the file (truncated)")
    return buffer[begin:end]


#: CRC-32 threads when the caller waits for the check: zlib releases the GIL, and cold
#: reads overlap, so one per core plus a few more keep the disk busy (a serial pass
#: cost ~0.5x of a whole import).
_WAITED_CRC_THREADS = 8
#: Beside a save: one sequential reader, which also pulls the pages in ahead of the
#: save's hashing. More threads faulting the same mapping cost system time (4 or 8:
#: ~+0.6 s of a 1.34 GB import on 2 cores) and made the import slower, not faster.
_BACKGROUND_CRC_THREADS = 1


class _CrcCheck:
    """The CRC-32 check of every stored storage record, running on threads from construction."""

    STEP = 64 << 20

    def __init__(self, used: list[tuple[Storage, zipfile.ZipInfo]], where: str, threads: int):
        self.where = where
        self.stored = [(storage, info) for storage, info in used if info.compress_type == zipfile.ZIP_STORED]
        self.cancelled = False
        pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckptfmt-crc")
        self.futures = [pool.submit(self._crc32, storage.data) for storage, _ in self.stored]
        pool.shutdown(wait=False)  # its threads end once the records are done

    def wait(self) -> None:
        """Block until every record is checked; CheckpointError names the first damaged one."""
        for (_, info), future in zip(self.stored, self.futures):
            if future.result() != info.CRC:
                self.cancel()
                raise CheckpointError(f"{self.where}: storage record {info.filename} is damaged (CRC-32 mismatch)")

    def cancel(self) -> None:
        """Stop checking: the import failed already; records being read stop at their next step."""
        self.cancelled = True
        for future in self.futures:
            future.cancel()

    def _crc32(self, view: memoryview) -> int | None:
        crc = 0
        for start in range(0, len(view), self.STEP):
            if self.cancelled:
                return None
            crc = zlib.crc32(view[start:start + self.STEP], crc)
        return crc


def _read_legacy(buffer: memoryview, where: str, depth: int, notes: set) -> tuple[Any, dict]:
    reader = BudgetReader(buffer)

    def plain(what: str) -> Any:
        try:
            return RestrictedUnpickler(reader, depth=depth, notes=notes, torch_files=load_object).load_checked()
        except PickleError as exc:
            raise CheckpointError(f"{where}: not a torch.save file ({what}: {exc})") from None

    if plain("magic number") != LEGACY_MAGIC:
        raise CheckpointError(f"{where}: not a torch.save file (wrong magic number)")
    protocol = plain("protocol version")
    if protocol != LEGACY_PROTOCOL:
        raise CheckpointError(f"{where}: legacy torch.save protocol {protocol!r}, expected {LEGACY_PROTOCOL}")
    sys_info = plain("sys_info")
    if type(sys_info) is not dict or sys_info.get("little_endian") is not True:
        raise CheckpointError(f"{where}: written on a big-endian machine or with malformed sys_info")
    pending: list[Storage] = []
    storages = _Storages(where, lambda key, storage: pending.append(storage))
    try:
        obj = RestrictedUnpickler(reader, persistent_load=storages, depth=depth, notes=notes,
                                  torch_files=load_object).load_checked()
    except PickleError as exc:
        raise CheckpointError(f"{where}: main pickle: {exc}") from None
    keys = plain("storage keys")
    if type(keys) is not list or not all(type(k) is str for k in keys):
        raise CheckpointError(f"{where}: malformed storage key list")
    if set(keys) != set(storages.by_key) or len(keys) != len(storages.by_key):
        raise CheckpointError(f"{where}: storage key list does not match the storages the pickle uses")
    pos = reader.tell()
    for key in keys:  # each: int64 element count, then the raw bytes
        storage = storages.by_key[key]
        if pos + 8 > len(buffer):
            raise CheckpointError(f"{where}: truncated: storage {key!r} missing")
        (count,) = struct.unpack("<q", buffer[pos:pos + 8])
        if count != storage.numel:
            raise CheckpointError(f"{where}: storage {key!r} holds {count} elements, the pickle says {storage.numel}")
        pos += 8
        end = pos + storage.nbytes
        if end > len(buffer):
            raise CheckpointError(f"{where}: truncated: storage {key!r} runs past the end of the file")
        try:
            storage.bind(buffer[pos:end])
        except PickleError as exc:
            raise CheckpointError(f"{where}: {exc}") from None
        pos = end
    if pos != len(buffer):
        notes.add(f"{len(buffer) - pos} bytes after the last storage were ignored")
    _note_locations(storages, notes)
    return obj, {"torch.save": "legacy", "torch.save legacy protocol": str(LEGACY_PROTOCOL)}

